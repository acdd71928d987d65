"""Trains a small decoder-only transformer language model in Flax NNX with jaxflash's causal
attention, and the same model with other attention functions for comparison: Flax's default
attention and, on an NVIDIA GPU, jax.nn's cuDNN attention.

The model reads characters of a procedurally generated text (short stories from a little
grammar, see ``make_corpus``), so nothing is downloaded. Each story repeats the names and the
object that its first sentences introduce, which the model can only predict by attending back
to them: attention, not just the local character statistics, lowers the loss.

Every run starts from the same parameters (the same seed) and sees the same batches, so their
losses differ only by floating-point rounding in the attention and should stay close; the
summary at the end reports each run's final loss and median tokens/s, and for every other run
jaxflash's tokens/s over its own and the largest loss difference from jaxflash's run.

The runs (``--attention``, a comma-separated list):

- ``jaxflash``: ``jaxflash.flax_attention``, given the causal mask a Flax model usually passes;
- ``default``: Flax's ``nnx.dot_product_attention``, given the same mask;
- ``cudnn``: ``jax.nn.dot_product_attention(..., implementation="cudnn")`` (``cudnn_attention``),
  the fast path a JAX user on an NVIDIA GPU would otherwise take, given ``is_causal=True``
  instead of the mask. It needs an NVIDIA GPU and ``--dtype bfloat16`` (cuDNN's attention takes
  16-bit inputs only).

By default all three, cudnn left out with a note where it cannot run (so on the CPU, and on a
GPU in float32); asked for by name where it cannot run, it is an error.

Run on the CPU (the default size, "small": both runs together take under a minute on two
cores):

  python examples/train_lm.py
  python examples/train_lm.py --attention jaxflash --steps 200

On a GPU (jaxflash built with CUDA), a larger model at sequence lengths 1024 and 2048:

  python examples/train_lm.py --size medium --dtype bfloat16
  python examples/train_lm.py --size large --dtype bfloat16
  python examples/train_lm.py --size large --dtype bfloat16 --attention jaxflash,cudnn --steps 60

``--help`` lists every option.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import flax
import numpy as np
import optax
from flax import nnx

import jaxflash

# Every character the grammar writes; a token is an index into this string.
ALPHABET = "\n ,.abcdefghijklmnopqrstuvwxyz"

NAMES = ("ada", "bram", "cleo", "dov", "edda", "fenn", "gus", "hild", "ivo", "juno", "kai",
         "lena", "milo", "nell", "otto", "pia")
THINGS = ("lamp", "kettle", "map", "rope", "coin", "drum", "basket", "key", "shovel", "flute")
ADJECTIVES = ("old", "red", "small", "heavy", "bright", "wooden", "broken", "new")
PLACES = ("mill", "harbour", "orchard", "bridge", "market", "forge", "well", "chapel")
# A story is one opening, one middle and one closing sentence; {a}, {b} and {thing} recur, so
# after the first sentences they are copies of earlier characters of the story.
OPENINGS = ("{a} met {b} at the {place}.", "at the {place}, {a} saw {b}.",
            "{a} and {b} walked to the {place}.")
MIDDLES = ("{a} gave {b} the {adjective} {thing}.", "{b} asked {a} for the {adjective} {thing}.",
           "{a} showed {b} a {adjective} {thing}.")
CLOSINGS = ("{b} thanked {a} for the {thing}.", "then {b} took the {thing} home.",
            "{a} kept the {thing}, and {b} left.")


@dataclasses.dataclass(frozen=True)
class Size:
  """A model and training size: its architecture and default training settings."""
  layers: int
  d_model: int
  heads: int
  seq_len: int
  batch: int
  steps: int
  learning_rate: float
  log_every: int


SIZES = {
    # tiny: for tests and a quick look (seconds on a CPU).
    "tiny": Size(layers=2, d_model=64, heads=4, seq_len=128, batch=8, steps=30,
                 learning_rate=3e-3, log_every=5),
    # small: the CPU default (about 35 s for both runs on two cores); at sequence length 256
    # the causal kernels skip about half of the attention's tiles, which the default attention
    # computes and then masks.
    "small": Size(layers=2, d_model=128, heads=4, seq_len=256, batch=8, steps=100,
                  learning_rate=3e-3, log_every=10),
    # medium and large: for a GPU, at sequence lengths where the T x T attention weights of the
    # default attention dominate its memory and time. On an H100 in bfloat16, jaxflash trained
    # medium at 1.2x and large at 1.8x the default attention's tokens/s; medium learns to copy
    # the names (loss 3.5 -> 0.6 in its 300 steps), while large, sized for speed, is still at
    # the character-statistics plateau (loss ~1.9) after its 300 steps at any learning rate of
    # 6e-4 to 2e-3. Those runs predate the cudnn run; in bfloat16 on an NVIDIA GPU it now runs
    # too, so that jaxflash is also measured against cuDNN's attention (issue 17).
    "medium": Size(layers=6, d_model=512, heads=8, seq_len=1024, batch=16, steps=300,
                   learning_rate=1e-3, log_every=25),
    "large": Size(layers=12, d_model=768, heads=12, seq_len=2048, batch=8, steps=300,
                  learning_rate=6e-4, log_every=25),
}


def cudnn_attention(query, key, value, bias=None, mask=None, broadcast_dropout: bool = True,
                    dropout_rng=None, dropout_rate: float = 0.0, deterministic: bool = False,
                    dtype=None, precision=None, module=None, is_causal: bool = False):
  """``jax.nn.dot_product_attention(..., implementation="cudnn")`` in Flax's ``attention_fn``
  convention (the arguments ``nnx.MultiHeadAttention`` passes, and ``bias``).

  Causality must come as ``is_causal``, with which cuDNN skips the tiles above the diagonal; a
  mask is refused rather than passed on, since cuDNN would read it as a dense T x S bias and
  skip nothing, which is not the fast path this run stands for. Attention dropout and sown
  weights, which jax.nn's cuDNN path does not have, are refused too. ``dtype`` casts query, key
  and value, as the other runs' attention functions do; ``precision`` is ignored, as Flax's
  default attention ignores it on its own jax.nn path (cuDNN multiplies 16-bit inputs with
  float32 accumulation whatever it says).
  """
  del broadcast_dropout, dropout_rng, precision  # dropout: refused below; precision: see above
  if mask is not None:
    raise ValueError("cudnn_attention: got a mask, which cuDNN would read as a dense bias; pass "
                     "is_causal=True instead of a causal mask")
  if dropout_rate > 0.0 and not deterministic:
    raise ValueError("cudnn_attention: attention dropout is not supported (jax.nn's cuDNN "
                     "attention has none)")
  if module is not None:
    raise ValueError("cudnn_attention: the module asked to sow its attention weights "
                     "(sow_weights=True), which cuDNN never forms")
  if dtype is not None:
    query, key, value = (jnp.asarray(x, dtype) for x in (query, key, value))
  return jax.nn.dot_product_attention(query, key, value, bias, is_causal=is_causal,
                                      implementation="cudnn")


@dataclasses.dataclass(frozen=True)
class Attention:
  """One run's attention: the ``attention_fn`` of ``nnx.MultiHeadAttention`` and how the model
  makes it causal."""
  attention_fn: Callable
  # True: the model passes is_causal=True and no mask. False: the (batch, 1, T, T) causal mask
  # of nnx.make_causal_mask, as a Flax model usually does.
  causal_by_flag: bool


ATTENTIONS = {
    "jaxflash": Attention(jaxflash.flax_attention, causal_by_flag=False),
    "default": Attention(nnx.dot_product_attention, causal_by_flag=False),
    "cudnn": Attention(cudnn_attention, causal_by_flag=True),
}


def cudnn_unavailable_reason(size: Size, dtype) -> str | None:
  """None when cuDNN's attention runs here for the model's shapes and dtype, else why not."""
  platform = jnp.zeros(()).device.platform
  if platform != "gpu":
    return f"cuDNN's attention needs an NVIDIA GPU, and JAX's default device here is {platform}"
  if dtype != jnp.bfloat16:
    return (f"cuDNN's attention takes 16-bit inputs only, and this run computes in {dtype} (use "
            f"--dtype bfloat16)")
  if "is_causal" not in inspect.signature(nnx.MultiHeadAttention.__call__).parameters:
    return (f"the cudnn run makes its attention causal by is_causal, which flax "
            f"{flax.__version__}'s nnx.MultiHeadAttention does not take (flax 0.12.2 and later do)")
  # Forward and backward compiled ahead for the model's attention shapes: whatever would stop
  # the cudnn run (a GPU that is not NVIDIA's, too old a GPU or cuDNN, a shape cuDNN does not
  # take) stops this first, as a reason instead of a trace from the middle of the runs.
  qkv = jax.ShapeDtypeStruct((size.batch, size.seq_len, size.heads, size.d_model // size.heads),
                             dtype)
  loss = lambda q, k, v: cudnn_attention(q, k, v, is_causal=True).astype(jnp.float32).sum()
  try:
    jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(qkv, qkv, qkv).compile()
  except Exception as error:  # noqa: BLE001 - whatever stops cuDNN here is the reason to report
    first_line = (str(error).strip().splitlines() or [""])[0]
    return f"cuDNN's attention does not compile here ({type(error).__name__}: {first_line})"
  return None


def make_corpus(num_chars: int, seed: int) -> np.ndarray:
  """At least ``num_chars`` characters of stories from the grammar, as token ids (uint8)."""
  rng = np.random.default_rng(seed)
  stories, length = [], 0
  while length < num_chars:
    a, b = rng.choice(NAMES, size=2, replace=False)
    words = dict(a=a, b=b, thing=rng.choice(THINGS), adjective=rng.choice(ADJECTIVES),
                 place=rng.choice(PLACES))
    sentences = [rng.choice(options).format(**words) for options in (OPENINGS, MIDDLES, CLOSINGS)]
    stories.append(" ".join(sentences) + "\n")
    length += len(stories[-1])
  token_of_byte = np.zeros(256, np.uint8)
  token_of_byte[np.frombuffer(ALPHABET.encode("ascii"), np.uint8)] = np.arange(len(ALPHABET))
  return token_of_byte[np.frombuffer("".join(stories).encode("ascii"), np.uint8)]


def batches(corpus: np.ndarray, batch: int, seq_len: int, seed: int):
  """Yields ``(batch, seq_len + 1)`` int32 windows at random offsets of the corpus: inputs are
  ``[:, :-1]``, targets ``[:, 1:]``. The same seed gives the same sequence of batches."""
  rng = np.random.default_rng(seed)
  offsets = np.arange(seq_len + 1)
  while True:
    starts = rng.integers(0, len(corpus) - seq_len - 1, size=batch)
    yield corpus[starts[:, None] + offsets].astype(np.int32)


class Block(nnx.Module):
  """A pre-LayerNorm transformer block: x + attention(norm(x)), then x + mlp(norm(x))."""

  def __init__(self, size: Size, attention_fn, dtype, rngs: nnx.Rngs):
    d = size.d_model
    self.attention_norm = nnx.LayerNorm(d, dtype=dtype, rngs=rngs)
    # No attention dropout: the comparison needs every run to compute the same function, while
    # jaxflash's dropout draws its own mask bits (not Flax's) and jax.nn's cuDNN attention has
    # none.
    self.attention = nnx.MultiHeadAttention(num_heads=size.heads, in_features=d, dtype=dtype,
                                            decode=False, attention_fn=attention_fn, rngs=rngs)
    self.mlp_norm = nnx.LayerNorm(d, dtype=dtype, rngs=rngs)
    self.mlp_in = nnx.Linear(d, 4 * d, dtype=dtype, rngs=rngs)
    self.mlp_out = nnx.Linear(4 * d, d, dtype=dtype, rngs=rngs)

  def __call__(self, x, causal_mask):
    """``causal_mask`` None: the attention is made causal by ``is_causal`` instead (an argument
    of ``nnx.MultiHeadAttention`` from flax 0.12.2, so only the cudnn run passes it)."""
    causality = dict(mask=causal_mask) if causal_mask is not None else dict(is_causal=True)
    x = x + self.attention(self.attention_norm(x), **causality)
    return x + self.mlp_out(nnx.gelu(self.mlp_in(self.mlp_norm(x))))


class LanguageModel(nnx.Module):
  """Token and learned position embeddings, pre-LayerNorm blocks, a final LayerNorm and an
  output head: ``(batch, length)`` token ids -> ``(batch, length, vocab)`` next-token logits."""

  def __init__(self, size: Size, vocab_size: int, attention: Attention, dtype, rngs: nnx.Rngs):
    # GPT-2's initialisation of the embeddings and the head: small enough that the first logits
    # are near 0, so the first loss is about log(vocab), the loss of a uniform guess.
    small_init = nnx.initializers.normal(0.02)
    self.token_embedding = nnx.Embed(vocab_size, size.d_model, dtype=dtype,
                                     embedding_init=small_init, rngs=rngs)
    self.position_embedding = nnx.Embed(size.seq_len, size.d_model, dtype=dtype,
                                        embedding_init=small_init, rngs=rngs)
    self.blocks = nnx.List([Block(size, attention.attention_fn, dtype, rngs)
                            for _ in range(size.layers)])
    self.causal_by_flag = attention.causal_by_flag
    self.final_norm = nnx.LayerNorm(size.d_model, dtype=dtype, rngs=rngs)
    # An untied head: with a character vocabulary it is vocab x d_model, a negligible share of
    # the parameters, so tying it to the token embedding would save nothing; untied, the
    # embedding's scale (added to the position embedding) and the logits' scale are learned
    # separately.
    self.head = nnx.Linear(size.d_model, vocab_size, dtype=dtype, kernel_init=small_init,
                           rngs=rngs)

  def __call__(self, tokens):
    x = self.token_embedding(tokens) + self.position_embedding(jnp.arange(tokens.shape[-1]))
    # A plain (batch, 1, T, T) causal mask: the default attention applies it as it is, while
    # jaxflash.flax_attention recognises it and runs the kernels with is_causal, which skip
    # the masked tiles instead of reading the mask. cuDNN cannot recognise a mask (it would
    # read it as a bias), so its run gets is_causal=True in its place.
    causal_mask = None if self.causal_by_flag else nnx.make_causal_mask(tokens, dtype=jnp.bool_)
    for block in self.blocks:
      x = block(x, causal_mask)
    return self.head(self.final_norm(x))


def make_optimizer(size: Size) -> optax.GradientTransformation:
  """AdamW with a linear warmup over the first tenth of the steps and a cosine decay to a tenth
  of the peak learning rate. Weight decay applies to the matrices only, as usual: pulling
  LayerNorm scales and biases towards 0 regularises nothing."""
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=size.learning_rate, warmup_steps=max(1, size.steps // 10),
      decay_steps=size.steps, end_value=size.learning_rate / 10)
  decay_matrices = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
  return optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(schedule, b2=0.95, weight_decay=0.1, mask=decay_matrices))


def train(attention: str, size: Size, dtype, corpus: np.ndarray, seed: int) -> dict:
  """Trains a fresh model with one attention function; returns its per-step losses and
  tokens/s and its compile time. Prints the loss every ``size.log_every`` steps, with the
  median tokens/s of the steps since the previous line."""
  model = LanguageModel(size, len(ALPHABET), ATTENTIONS[attention], dtype, nnx.Rngs(seed))
  # jax.jit over the parameters as a pytree (nnx.split / nnx.merge): the graph is traversed
  # once at tracing, not at every step as nnx.jit would.
  graphdef, params = nnx.split(model, nnx.Param)
  optimizer = make_optimizer(size)

  def loss_fn(params, tokens):
    logits = nnx.merge(graphdef, params)(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32),
                                                           tokens[:, 1:]).mean()

  def train_step(params, optimizer_state, tokens):
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
    updates, optimizer_state = optimizer.update(grads, optimizer_state, params)
    return optax.apply_updates(params, updates), optimizer_state, loss

  optimizer_state = optimizer.init(params)
  data = batches(corpus, size.batch, size.seq_len, seed)
  tokens = jax.device_put(next(data))
  start = time.perf_counter()
  # Compiled ahead so that no step's time includes compilation.
  step = jax.jit(train_step, donate_argnums=(0, 1)).lower(params, optimizer_state,
                                                          tokens).compile()
  compile_s = time.perf_counter() - start

  tokens_per_step = size.batch * size.seq_len
  losses, tokens_per_s = [], []
  logged = 0  # steps already summarised in a printed line
  print(f"[{attention}] compiled in {compile_s:.1f} s; {tokens_per_step} tokens per step")
  for i in range(size.steps):
    start = time.perf_counter()
    params, optimizer_state, loss = step(params, optimizer_state, tokens)
    losses.append(float(loss))  # waits for the step
    tokens_per_s.append(tokens_per_step / (time.perf_counter() - start))
    if i % size.log_every == 0 or i == size.steps - 1:
      print(f"[{attention}] step {i:4d}  loss {losses[-1]:.4f}  "
            f"tokens/s {statistics.median(tokens_per_s[logged:]):9.0f}")
      logged = i + 1
    tokens = jax.device_put(next(data))
    tokens.block_until_ready()  # so that the next step's time is the step's alone
  return dict(losses=losses, tokens_per_s=tokens_per_s, compile_s=compile_s)


def attention_names(text: str) -> tuple[str, ...]:
  """``--attention``'s value: comma-separated names of ATTENTIONS, each at most once."""
  names = tuple(name.strip() for name in text.split(","))
  unknown = [name for name in names if name not in ATTENTIONS]
  if unknown:
    raise argparse.ArgumentTypeError(f"unknown attention {', '.join(map(repr, unknown))}; choose "
                                     f"from {', '.join(ATTENTIONS)}")
  if len(set(names)) != len(names):
    raise argparse.ArgumentTypeError(f"an attention named twice in {text!r}")
  return names


def make_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      description="Train a small character-level transformer LM (Flax NNX) with jaxflash's "
                  "causal attention and with other attention functions (Flax's default, "
                  "jax.nn's cuDNN), from the same initialisation on the same batches, and "
                  "compare their losses and speed.")
  parser.add_argument("--attention", type=attention_names, metavar="NAMES",
                      help="the runs, comma-separated, one after the other: jaxflash "
                           "(jaxflash.flax_attention), default (Flax's nnx.dot_product_attention), "
                           "cudnn (jax.nn.dot_product_attention with implementation='cudnn': needs "
                           "an NVIDIA GPU and --dtype bfloat16) (default: all three, cudnn left "
                           "out with a note where it cannot run)")
  parser.add_argument("--size", choices=tuple(SIZES), default="small",
                      help="model and training size: " + "; ".join(
                          f"{name}: {s.layers} layers, d_model {s.d_model}, {s.heads} heads, "
                          f"seq {s.seq_len}, batch {s.batch}, {s.steps} steps"
                          for name, s in SIZES.items())
                      + ". tiny and small are for the CPU, medium and large for a GPU "
                        "(default: %(default)s)")
  parser.add_argument("--steps", type=int, help="training steps (default: the size's)")
  parser.add_argument("--seq-len", type=int,
                      help="tokens per sequence, the attention's length (default: the size's)")
  parser.add_argument("--batch", type=int, help="sequences per step (default: the size's)")
  parser.add_argument("--learning-rate", type=float,
                      help="peak learning rate of the warmup + cosine schedule (default: the "
                           "size's)")
  parser.add_argument("--log-every", type=int,
                      help="print the loss and tokens/s every this many steps (default: the "
                           "size's)")
  parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                      help="computation dtype of the model (parameters and optimizer stay "
                           "float32); bfloat16 for GPUs (default: %(default)s)")
  parser.add_argument("--seed", type=int, default=0,
                      help="seed of the parameters, the generated text and the batch order "
                           "(default: %(default)s)")
  return parser


def main(argv: list[str] | None = None) -> dict:
  """Runs the trainings that ``argv`` asks for; returns, per attention run, its ``losses``,
  ``tokens_per_s`` (per step) and ``compile_s``, and where jaxflash ran too, for each other run
  its ``max_loss_difference`` from jaxflash's losses and ``jaxflash_tokens_per_s_ratio``
  (jaxflash's median tokens/s over its own)."""
  parser = make_parser()
  args = parser.parse_args(argv)
  overrides = dict(steps=args.steps, seq_len=args.seq_len, batch=args.batch,
                   learning_rate=args.learning_rate, log_every=args.log_every)
  size = dataclasses.replace(SIZES[args.size],
                             **{k: v for k, v in overrides.items() if v is not None})
  dtype = jnp.dtype(args.dtype)
  attentions = args.attention or tuple(ATTENTIONS)
  # Checked before any run, so that a cudnn run that cannot happen stops nothing half-way.
  cudnn_left_out = None
  if "cudnn" in attentions:
    cudnn_left_out = cudnn_unavailable_reason(size, dtype)
    if cudnn_left_out is not None:
      if args.attention:
        parser.error(f"--attention cudnn: {cudnn_left_out}")
      attentions = tuple(name for name in attentions if name != "cudnn")
  # Enough text that the batches rarely repeat a window (2^20 to 2^24 characters).
  corpus = make_corpus(max(1 << 20, min(size.steps * size.batch * size.seq_len, 1 << 24)),
                       args.seed)
  print(f"size {args.size}: {size.layers} layers, d_model {size.d_model}, {size.heads} heads, "
        f"seq_len {size.seq_len}, batch {size.batch}, {size.steps} steps, {args.dtype}, on "
        f"{jnp.zeros(()).device.platform}; corpus {len(corpus)} characters")
  if cudnn_left_out is not None:
    print(f"cudnn left out: {cudnn_left_out}")

  results = {name: train(name, size, dtype, corpus, args.seed) for name in attentions}

  print(f"\n{'attention':<10} {'first loss':>10} {'final loss':>10} {'median tokens/s':>16} "
        f"{'compile s':>9}")
  for name, run in results.items():
    print(f"{name:<10} {run['losses'][0]:10.4f} {run['losses'][-1]:10.4f} "
          f"{statistics.median(run['tokens_per_s']):16.0f} {run['compile_s']:9.1f}")
  if "jaxflash" in results:
    ours = results["jaxflash"]
    for name, run in results.items():
      if name == "jaxflash":
        continue
      run["max_loss_difference"] = max(abs(a - b) for a, b in zip(ours["losses"], run["losses"]))
      run["jaxflash_tokens_per_s_ratio"] = (statistics.median(ours["tokens_per_s"]) /
                                            statistics.median(run["tokens_per_s"]))
      print(f"jaxflash / {name} median tokens/s: {run['jaxflash_tokens_per_s_ratio']:.2f}x; "
            f"max |loss difference| over {size.steps} steps: {run['max_loss_difference']:.2e}")
  return results


if __name__ == "__main__":
  main()
