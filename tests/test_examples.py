"""examples/train_lm.py, run in-process at its tiny size on each backend (conftest.py's
`backend`): the language model trains (its loss is finite and falls) and jaxflash's attention
trains it as Flax's default attention does (same initialisation and batches, so the same losses
up to rounding). Its cudnn run needs an NVIDIA GPU and bfloat16, so here only its refusals are
tested: the command line's, and its attention function's for what cuDNN cannot do.

examples/ is not a package, so the example is imported from its path.
"""

from __future__ import annotations

import importlib.util
import math
import os
import statistics
import sys

import jax.numpy as jnp
import pytest

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples",
                       "train_lm.py")
STEPS = 30

# Step 0: the same parameters and batch, so the two losses differ only by the attention's
# rounding, averaged over the 1024 predicted tokens of the batch: measured, 0 on the CPU
# (float32) and 3e-6 on an H100 (float32 on tf32 tensor cores, both attentions). An attention
# that computes something else moves the first loss by more: one without the causal mask by
# 3e-3, one whose mask also hides the diagonal by 2e-4.
FIRST_LOSS_TOLERANCE = 1e-4
# Later steps: the rounding differences enter the parameters and grow with training, to a
# measured 2e-7 (CPU) and 1.2e-5 (H100) at most over the 30 steps, 80x under this. Without the
# causal mask the losses end up 8e-2 apart, with the diagonal hidden 1.7e-2, with the attention
# logits scaled by 1.1 1.6e-2 and by 1.01 1.7e-3.
LOSS_TOLERANCE = 1e-3


def _load_example():
  spec = importlib.util.spec_from_file_location("examples_train_lm", EXAMPLE)
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # its dataclasses look their module up there
  spec.loader.exec_module(module)
  return module


def test_train_lm_loss_falls_and_jaxflash_matches_default_attention(backend, capsys):
  # The default runs: cudnn is left out with a note, on the CPU for want of an NVIDIA GPU and on
  # the GPU because the default dtype is float32.
  results = _load_example().main(["--size", "tiny", "--steps", str(STEPS)])
  assert "cudnn left out: " in capsys.readouterr().out
  assert set(results) == {"jaxflash", "default"}

  for name in ("jaxflash", "default"):
    losses = results[name]["losses"]
    assert len(losses) == STEPS
    assert all(math.isfinite(loss) for loss in losses), f"{name}: non-finite loss in {losses}"
    # From about log(30) = 3.4 (a uniform guess over the alphabet) to under 2.7 in 30 steps;
    # the mean of the last five steps, since single batches vary.
    final = sum(losses[-5:]) / 5
    assert final < losses[0] - 0.7, f"{name}: the loss did not fall: {losses}"

  ours, default = results["jaxflash"]["losses"], results["default"]["losses"]
  assert abs(ours[0] - default[0]) <= FIRST_LOSS_TOLERANCE, (ours[0], default[0])
  differences = [abs(a - b) for a, b in zip(ours, default)]
  assert max(differences) <= LOSS_TOLERANCE, f"jaxflash {ours}\ndefault {default}"
  assert results["default"]["max_loss_difference"] == max(differences)
  assert results["default"]["jaxflash_tokens_per_s_ratio"] == (
      statistics.median(results["jaxflash"]["tokens_per_s"]) /
      statistics.median(results["default"]["tokens_per_s"]))


def _command_line_error(capsys, argv) -> str:
  """The message with which the example's command line refuses ``argv``."""
  with pytest.raises(SystemExit) as exit_info:
    _load_example().main(argv)
  assert exit_info.value.code == 2  # argparse's usage error, not a trace
  return capsys.readouterr().err


def test_train_lm_refuses_cudnn_where_it_cannot_run(backend, capsys):
  error = _command_line_error(capsys, ["--size", "tiny", "--attention", "jaxflash,cudnn"])
  reason = "needs an NVIDIA GPU" if backend == "cpu" else "use --dtype bfloat16"
  assert "--attention cudnn: cuDNN's attention " in error and reason in error, error


@pytest.mark.parametrize("names, message", [
    ("jaxflash,flash", "unknown attention 'flash'; choose from jaxflash, default, cudnn"),
    ("default,jaxflash,default", "an attention named twice"),
])
def test_train_lm_refuses_bad_attention_names(capsys, names, message):
  assert message in _command_line_error(capsys, ["--attention", names])


@pytest.mark.parametrize("arguments, message", [
    (dict(mask=jnp.ones((1, 1, 4, 4), bool)), "pass is_causal=True instead of a causal mask"),
    (dict(dropout_rate=0.1), "attention dropout is not supported"),
    (dict(module=object()), "sow its attention weights"),
])
def test_cudnn_attention_refuses_what_cudnn_cannot_do(arguments, message):
  q = jnp.zeros((1, 4, 2, 8), jnp.bfloat16)
  with pytest.raises(ValueError, match=message):
    _load_example().cudnn_attention(q, q, q, is_causal=True, **arguments)
