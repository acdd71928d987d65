"""Ring attention: attention over a sequence sharded along mesh axes.

Each of the n devices on the ring holds a block of the queries and a block of
the keys/values. The K/V blocks travel round the ring by collective permutes
(the next block's send is issued before the current one is computed on; XLA's
schedule decides whether they overlap: docs/DESIGN.md, Multi-device), and each
device merges the partial results of its queries by their logsumexp (in base 2
and as two floats per row, as the kernels write it: cuda/params.h):

  lse = log2(2^lse_a + 2^lse_b),  o = 2^(lse_a - lse) o_a + 2^(lse_b - lse) o_b

so that no device ever holds more than two K/V blocks, and nothing T x S. The
backward runs the same ring with the merged lse and delta = rowsum(dO o O):
dQ accumulates where it is, and the dK/dV of a block travel with the block and
are sent home at the end.

Causal attention (top-left, T == S) needs only whole blocks: a key block before
the query block is seen whole, the diagonal one causally, a later one not at
all. In the contiguous order, device i would then compute i + 1 blocks and
device n - 1 n of them; the zig-zag order balances them: the sequence is cut
into 2n chunks and device i holds chunks i and 2n - 1 - i, so that after the
diagonal step every device computes exactly half a block pair: all its queries
against the first chunk of an earlier device's keys, or its later chunk of
queries against all of a later device's keys.

A local window (contiguous order, equal lengths) needs only the blocks in its
reach: each kernel call gets the pair's diagonal offset (query block start minus
key block start) and computes just the rows and keys the window lets meet, and
the ring stops when the window's reach ends: a causal sliding window of w
positions over blocks of T takes ceil(w / T) steps instead of n - 1. A window
that reaches both ways but not round the ring runs one short pass each way.
Blocks travel with only the key rows their remaining steps read, and each step
merges only the query rows it wrote, so a window of w moves and merges w rows a
step, not a whole block.

Segment ids and sequence lengths (top-left) ride along: the key ids travel with their K/V
block, cut to the same rows; the query ids stay with the query block; and each kernel call
gets its task's slices of the ids and the lengths as its own rows see them (Ring.local_length:
from the global positions of the task's rows, which depend on the device and, in the zig-zag
order, the chunk). A row that sees no key in a task comes back 0 / -inf and merges as nothing.

Dropout draws the unsharded call's mask: its hash keys on the positions of the query and the
key in the whole sequence (cuda/dropout.h), so each kernel call gets, with its seed words, the
positions of its first row and key (placed_seed), which depend on the device. A call must
therefore cover consecutive positions: in the zig-zag order a task over both chunks of a block
runs as one call per pair of chunks (Ring.calls), which the step merges as it merges steps.
And a key block must start at a multiple of 16 positions, where the hash's pairs of keys start
(DROPOUT_KEY_ALIGNMENT): key blocks (zig-zag: chunks) of a multiple of 16 positions, and window
tasks whose keys start at one (plan's key_align); dropout_misaligned says when blocks are not.

Used two ways: jaxflash.ring_attention inside shard_map (the caller chooses the
order), and the partitioning stage when jit's operands are sharded along the
sequence (it permutes the contiguous shards into zig-zag order and back).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Literal

import jax
import jax.numpy as jnp
from jax import lax

from jaxflash import kernels
from jaxflash.contract import (OPTIONAL_INPUTS, QUERY_ROW_SLOTS, UNBOUNDED, Flag, KernelConfig,
                               absent)
from jaxflash.layout import COL, ROW, Layout, role_axis, shape_of, with_cols, with_rows

Order = Literal["contiguous", "zigzag"]
AxisName = str | tuple[str, ...]

OPEN = (UNBOUNDED, UNBOUNDED)  # KernelConfig.window of full attention
CAUSAL = (UNBOUNDED, 0)


# The optional operands the ring takes (besides a traced scale): the query's segment ids and
# lengths stay with the local query block, the key ids travel round with their K/V block, and
# every kernel call gets the slices and the lengths of its own rows, and the dropout's seed
# words with its place in the sequence (Ring.task_operands).
RING_OPERANDS = ("q_lens", "kv_lens", "seed", "q_segment_ids", "kv_segment_ids")

# The dropout's hash decides keys s and s + 8 of each 16 together, and every kernel holds
# both in one thread, counting from its block's first key: that key's position in the sequence
# must be a multiple of 16, or the block's pairs would not be the sequence's (cuda/dropout.h).
DROPOUT_KEY_ALIGNMENT = 16


def unsupported(config: KernelConfig) -> str | None:
  """Why ring attention cannot compute this call, or None if it can."""
  T, S = config.seq_dims[:2]
  for slot, what in (("bias", "a bias"), ("mask", "a mask"), ("alibi_slopes", "alibi_slopes")):
    if config.layout(slot) is not None:
      return f"{what} is not supported yet"
  if config.window != OPEN and T != S:
    what = "causal attention" if config.window == CAUSAL else "a local window"
    return f"{what} needs equal query and key lengths, got {T} and {S}"
  has_lengths = config.has(Flag.HAS_Q_LENS) or config.has(Flag.HAS_KV_LENS)
  if config.window != OPEN and has_lengths and config.has(Flag.BOTTOM_RIGHT):
    return ("mask_alignment='bottom_right' with sequence lengths is not supported yet (its "
            "diagonal moves with kv_len - q_len per batch item)")
  return None


def dropout_misaligned(config: KernelConfig, order: Order) -> str | None:
  """Why the ring cannot apply dropout to the local blocks of `config` (one device's) in `order`,
  or None if it can (or there is no dropout): their key pieces must start at multiples of
  DROPOUT_KEY_ALIGNMENT positions."""
  if not config.has(Flag.DROPOUT):
    return None
  S = config.seq_dims[1]
  piece, what = (S // 2, "zig-zag chunks") if order == "zigzag" else (S, "key blocks")
  if piece % DROPOUT_KEY_ALIGNMENT:
    return (f"dropout needs {what} of a multiple of {DROPOUT_KEY_ALIGNMENT} positions (where "
            f"the mask's hash pairs its keys), got {piece}")
  return None


@dataclasses.dataclass(frozen=True)
class Task:
  """Query rows [q0, q0 + tq) of the local block against key rows [k0, k0 + tk) of the visiting
  one, under `window` with its diagonal shifted by `diagonal` (KernelConfig's)."""
  q0: int
  tq: int
  k0: int
  tk: int
  window: tuple[int, int] = OPEN
  diagonal: int = 0


def placed_task(T: int, S: int, window: tuple[int, int], offset: int,
                key_align: int = 1) -> Task | None:
  """The task of a query block of T rows against a key block of S rows that starts `offset`
  positions before it in the sequence, cut down to the rows and keys the window lets meet;
  None if it lets none meet. Key s sees query t iff -left <= s - t - offset <= right. Its keys
  start at a multiple of `key_align` (dropout's: DROPOUT_KEY_ALIGNMENT), the window masking
  those it took in before the first one it lets meet."""
  left, right = window
  q0 = 0 if right == UNBOUNDED else max(0, -offset - right)
  q1 = T if left == UNBOUNDED else min(T, S + left - offset)
  k0 = 0 if left == UNBOUNDED else max(0, offset - left) // key_align * key_align
  k1 = S if right == UNBOUNDED else min(S, T + offset + right)
  if q0 >= q1 or k0 >= k1:
    return None
  diagonal = offset + q0 - k0
  # Drop the window where it masks nothing: the kernels then test no element.
  inside = ((left == UNBOUNDED or -(q1 - q0 - 1) - diagonal >= -left) and
            (right == UNBOUNDED or (k1 - k0 - 1) - diagonal <= right))
  if inside:
    return Task(q0, q1 - q0, k0, k1 - k0)
  return Task(q0, q1 - q0, k0, k1 - k0, window, diagonal)


Branches = tuple[Task | None, Task | None]
Span = tuple[int, int]  # rows [lo, hi) of a block


def _union(spans) -> Span | None:
  spans = [span for span in spans if span is not None]
  return (min(lo for lo, _ in spans), max(hi for _, hi in spans)) if spans else None


@dataclasses.dataclass(frozen=True)
class Pass:
  """K/V blocks going `direction` (+1 or -1) round the ring: at step k device i computes on the
  block of device i - direction k (mod n). steps[k] is its task when that device comes before
  device i in the sequence, and when after (None: no work).

  A step's results cover the union of its tasks' rows (query_span, key_span), so that both
  branches of its lax.cond agree and nothing outside is merged; a travelling block carries
  only the key rows its remaining steps read (keys_held), its dK/dV only the rows its steps
  wrote (keys_touched): a window that reaches w keys into the next block sends w rows, not S."""
  direction: int
  steps: tuple[Branches, ...]

  def query_span(self, step: int) -> Span | None:
    return _union((t.q0, t.q0 + t.tq) for t in self.steps[step] if t is not None)

  def key_span(self, step: int) -> Span | None:
    return _union((t.k0, t.k0 + t.tk) for t in self.steps[step] if t is not None)

  def keys_held(self, step: int, S: int) -> Span:
    """The key rows of the block on a device at `step` (step 0: the local block, whole)."""
    if step == 0:
      return (0, S)
    return _union(self.key_span(j) for j in range(step, len(self.steps)))

  def keys_touched(self, step: int) -> Span | None:
    """The key rows of the travelling block whose dK/dV steps 1..step wrote."""
    return _union(self.key_span(j) for j in range(1, step + 1))


def plan(seq_dims: tuple[int, int], window: tuple[int, int], order: Order, n: int,
         key_align: int = 1) -> list[Pass]:
  """The passes of a ring of n devices over local blocks of T queries and S keys, whose tasks'
  keys start at multiples of `key_align` (placed_task)."""
  T, S = seq_dims
  if order == "zigzag" and window != OPEN:  # causal (ring_attention checks)
    diagonal = Task(0, T, 0, S, CAUSAL)
    earlier = Task(0, T, 0, S // 2)      # all queries, the keys' first chunk
    later = Task(T // 2, T // 2, 0, S)   # the later query chunk, all keys
    return [Pass(1, ((diagonal, diagonal),) + ((earlier, later),) * (n - 1))]
  # Contiguous order: device i holds query positions [iT, (i + 1)T) and key positions
  # [iS, (i + 1)S); whenever the window bounds anything, T == S (unsupported()).
  back = lambda k: placed_task(T, S, window, k * T, key_align)    # the key block k devices before
  ahead = lambda k: placed_task(T, S, window, -k * T, key_align)  # the key block k devices after
  local = (back(0), back(0))
  reach_back = max((k for k in range(1, n) if back(k)), default=0)
  reach_ahead = max((k for k in range(1, n) if ahead(k)), default=0)
  if reach_ahead and reach_back + reach_ahead < n - 1:
    # A window reaching both ways but not round the ring: a short pass each way.
    return [Pass(1, (local,) + tuple((back(k), None) for k in range(1, reach_back + 1))),
            Pass(-1, ((None, None),) + tuple((None, ahead(k)) for k in range(1, reach_ahead + 1)))]
  # One way round: the block k devices before arrives at step k, the one n - k after too.
  last = n - 1 if reach_ahead else reach_back
  return [Pass(1, (local,) + tuple((back(k), ahead(n - k)) for k in range(1, last + 1)))]


@dataclasses.dataclass(frozen=True)
class Ring:
  """One device's view of the ring: the local config (rows T, S of the local blocks)."""
  config: KernelConfig
  axis_name: AxisName
  order: Order

  @property
  def size(self) -> int:
    return lax.axis_size(self.axis_name)

  def passes(self) -> list[Pass]:
    key_align = DROPOUT_KEY_ALIGNMENT if self.config.has(Flag.DROPOUT) else 1
    return plan(self.config.seq_dims[:2], self.config.window, self.order, self.size, key_align)

  def task_config(self, task: Task, config: KernelConfig | None = None) -> KernelConfig:
    """The config of a kernel call on `task` (one of Ring.calls' with dropout)."""
    config = config or self.config
    layouts = {slot: with_rows(layout, task.tq if slot in QUERY_ROW_SLOTS else task.tk)
               for slot, layout in config.layouts}
    # Positions are the task's own: the blocks' offsets are in `diagonal`, and the length
    # operands are the task's (Ring.task_operands). The diagonal is top-left: with a window
    # T == S, and bottom-right with lengths is unsupported().
    config = config.replace(seq_dims=(task.tq, task.tk, *config.seq_dims[2:]), window=task.window,
                            diagonal=task.diagonal,
                            flags=config.flags & ~Flag.BOTTOM_RIGHT).with_layouts(layouts)
    return placed_config(config) if config.has(Flag.DROPOUT) else config

  def _pieces(self, device, rows: int) -> list[tuple[int, jax.Array, int]]:
    """(block row, sequence position, rows) of each contiguous piece of `device`'s block of
    `rows` rows, in block order, which is also the sequence's: the contiguous order's one
    piece, the zig-zag order's two chunks."""
    if self.order == "zigzag":
      c = rows // 2
      first, second = _zigzag_chunks(device, self.size)
      return [(0, first * c, c), (c, second * c, c)]
    return [(0, device * rows, rows)]

  def _spans(self, device, rows: int, start: int, size: int):
    """(lo, hi, position) of each piece of `device`'s block (of `rows` rows) that rows
    [start, start + size) overlap: its block rows [lo, hi), the first at sequence `position`."""
    for first, position, n in self._pieces(device, rows):
      lo, hi = max(start, first), min(start + size, first + n)
      if lo < hi:
        yield lo, hi, position + (lo - first)

  def local_length(self, length, device, rows: int, start: int, size: int):
    """How many of rows [start, start + size) of `device`'s block (of `rows` rows) come before
    sequence position `length` (per batch item, traced): the length of a kernel call on those
    rows. Its pieces lie in sequence order, so the rows before `length` are a prefix."""
    total = jnp.zeros_like(length)
    for lo, hi, position in self._spans(device, rows, start, size):
      total = total + jnp.clip(length - position, 0, hi - lo)
    return total

  def calls(self, task: Task, src) -> list[tuple[Task, tuple | None]]:
    """The kernel calls of `task` on the visiting block of device `src`, with the place of
    each in the sequence (the positions of its first query and key, traced) for the dropout's
    hash. Without dropout, the task itself (no place). With it, a call must cover consecutive
    positions: one per pair of the pieces (zig-zag chunks) the task's rows and keys overlap, cut
    to what the task's window lets meet there (its diagonal moves with the pair's corner)."""
    if not self.config.has(Flag.DROPOUT):
      return [(task, None)]
    T, S = self.config.seq_dims[:2]
    calls = []
    for q_lo, q_hi, row in self._spans(lax.axis_index(self.axis_name), T, task.q0, task.tq):
      for k_lo, k_hi, col in self._spans(src, S, task.k0, task.tk):
        part = placed_task(q_hi - q_lo, k_hi - k_lo, task.window,
                           task.diagonal + (q_lo - task.q0) - (k_lo - task.k0),
                           DROPOUT_KEY_ALIGNMENT)
        if part is not None:
          calls.append((Task(q_lo + part.q0, part.tq, k_lo + part.k0, part.tk, part.window,
                             part.diagonal), (row + part.q0, col + part.k0)))
    return calls

  def task_operands(self, task: Task, src, operands: dict, kv_ids=None, place=None) -> dict:
    """The optional operands of `task` on the visiting block of device `src`, by slot: the
    query segment ids' task rows, the visiting key ids (`kv_ids`, already cut to the task's
    keys), the lengths as the task's rows see them, and the seed words placed at `place`
    (Ring.calls). `operands`: this device's (RING_OPERANDS: its query block's ids, its own key
    block's ids, the lengths and the seed words)."""
    i = lax.axis_index(self.axis_name)
    T, S = self.config.seq_dims[:2]
    present = {}
    if "seed" in operands:
      present["seed"] = placed_seed(operands["seed"], self.config.layout("seed"), *place)
    if "q_lens" in operands:
      present["q_lens"] = self.local_length(operands["q_lens"], i, T, task.q0, task.tq)
    if "kv_lens" in operands:
      present["kv_lens"] = self.local_length(operands["kv_lens"], src, S, task.k0, task.tk)
    if "q_segment_ids" in operands:
      present["q_segment_ids"] = _rows(operands["q_segment_ids"],
                                       self.config.layout("q_segment_ids"), task.q0, task.tq)
      present["kv_segment_ids"] = kv_ids
    return present

  def shift(self, tree, by: int = 1):
    """Sends each device's `tree` to the device `by` places on round the ring."""
    n = self.size
    if by % n == 0:
      return tree
    return lax.ppermute(tree, self.axis_name, [(j, (j + by) % n) for j in range(n)])

  def run(self, step: int, direction: int, branches: Branches,
          compute: Callable[..., tuple], idle: Callable[[], tuple], *operands):
    """compute(task, *operands) for this device's task at `step` of a pass going `direction`;
    idle() where it has none."""
    earlier, later = branches
    fn = lambda task: ((lambda *a: compute(task, *a)) if task is not None else
                       (lambda *a: _varying_like(idle(), a[0])))
    if earlier == later:
      return fn(earlier)(*operands)
    i = lax.axis_index(self.axis_name)
    src_is_earlier = (i - direction * step) % self.size < i
    return lax.cond(src_is_earlier, fn(earlier), fn(later), *operands)


def varying_axes(x) -> frozenset:
  """The manual mesh axes (inside shard_map) that x's value varies over; empty outside."""
  manual = getattr(jax.typeof(x), "manual_axis_type", None)
  return frozenset(manual.varying) if manual is not None and manual.varying else frozenset()


def _varying_like(tree, like):
  """tree's arrays typed as varying over the manual mesh axes (shard_map's) that `like` varies
  over: the branches of a lax.cond must agree, and zeros made inside one vary over none."""
  axes = tuple(sorted(varying_axes(like)))
  if not axes:
    return tree
  return jax.tree.map(lambda x: lax.pcast(x, axes, to="varying"), tree)


def placed_config(config: KernelConfig) -> KernelConfig:
  """The config of a dropout call on a block of a larger problem: its seed operand carries the
  block's place (placed_seed; Flag.DROPOUT_OFFSETS)."""
  return config.replace(flags=config.flags | Flag.DROPOUT_OFFSETS).with_layouts(
      {"seed": with_cols(config.layout("seed"), 4)})


def placed_seed(seed, layout: Layout, row, col):
  """The seed operand (laid out as `layout`) of a call on the block of a larger problem whose
  first query and key are at positions `row` and `col` there (traced or not; col a multiple of
  DROPOUT_KEY_ALIGNMENT): each instance's seed words and then the two positions, which the
  kernels add to their own (cuda/dropout.h). Words, not attributes: on the ring they depend on
  the device, and one program runs on every device."""
  axis = role_axis(layout, COL)
  place = jnp.stack([jnp.asarray(row), jnp.asarray(col)]).astype(jnp.uint32)
  place = jnp.reshape(place, [2 if d == axis else 1 for d in range(seed.ndim)])
  shape = seed.shape[:axis] + (2,) + seed.shape[axis + 1:]
  return jnp.concatenate([seed, jnp.broadcast_to(place, shape)], axis=axis)


def _rows(x, layout: Layout, start: int, size: int):
  return lax.slice_in_dim(x, start, start + size, axis=role_axis(layout, ROW))


def _pad_rows(x, layout: Layout, start: int, total: int, value):
  """x's rows placed at [start, start + rows) of `total` rows, the rest `value`."""
  axis = role_axis(layout, ROW)
  config = [(0, 0, 0)] * x.ndim
  config[axis] = (start, total - start - x.shape[axis], 0)
  return lax.pad(x, jnp.asarray(value, x.dtype), config)


def _optional_operands(dtype, scale, present: dict):
  """The kernels' optional operands: the scale operand, when the scale is traced (None:
  static), those `present` (Ring.task_operands), and placeholders for the rest (unsupported()
  refuses them)."""
  present = dict(present, **({"scale": scale} if scale is not None else {}))
  return tuple(present[slot] if slot in present else absent(slot, dtype)
               for slot in OPTIONAL_INPUTS)


def _zeros(layout: Layout, rows: int):
  return jnp.zeros(shape_of(with_rows(layout, rows)), jnp.float32)


def _update_rows(x, layout: Layout, span: Span, update):
  """x with rows [span) replaced by update(those rows)."""
  axis = role_axis(layout, ROW)
  lo, hi = span
  if (lo, hi) == (0, x.shape[axis]):
    return update(x)
  part = update(lax.slice_in_dim(x, lo, hi, axis=axis))
  return lax.dynamic_update_slice_in_dim(x, part, lo, axis)


def _two_sum(a, b):
  """(hi, lo) with hi = fl(a + b) and hi + lo == a + b exactly (cuda/params.h, split_lse)."""
  hi = a + b
  b_part = hi - a
  return hi, (a - (hi - b_part)) + (b - b_part)


def _merge(acc, part, o_layout: Layout, lse_layout: Layout):
  """The logsumexp merge of two partial (o, lse) of the same queries. lse is the kernels'
  (base 2, hi and lo along its COL axis, cuda/params.h), and so is the merged one: each side's
  log-sum is taken relative to the larger hi, where hi - base is exact and small, and the
  merged pair is base + that log-sum, split again without rounding."""
  (o_a, lse_a), (o_b, lse_b) = acc, part
  col = role_axis(lse_layout, COL)
  hi_lo = lambda lse: (lax.index_in_dim(lse, 0, col, False), lax.index_in_dim(lse, 1, col, False))
  (hi_a, lo_a), (hi_b, lo_b) = hi_lo(lse_a), hi_lo(lse_b)
  top = jnp.maximum(hi_a, hi_b)
  empty = jnp.isneginf(top)  # rows that see no key yet stay 0 / (-inf, 0)
  base = jnp.where(empty, 0.0, top)
  relative = lambda hi, lo: jnp.where(jnp.isneginf(hi), -jnp.inf, (hi - base) + lo)
  rel_a, rel_b = relative(hi_a, lo_a), relative(hi_b, lo_b)
  log_sum = jnp.where(empty, 0.0, jnp.logaddexp2(rel_a, rel_b))
  weight = lambda rel: jnp.expand_dims(jnp.exp2(rel - log_sum), role_axis(o_layout, COL))
  hi, lo = _two_sum(base, log_sum)
  lse = jnp.stack([jnp.where(empty, -jnp.inf, hi), jnp.where(empty, 0.0, lo)], axis=col)
  return o_a * weight(rel_a) + o_b * weight(rel_b), lse


def _travel(ring: Ring, ring_pass: Pass, block: tuple, slots: tuple[str, ...], S: int):
  """Per step of the pass: (step, branches, the block on this device, the key rows it holds).
  `block`: this device's arrays of the key rows that travel (K, V and the key segment ids), of
  `slots`. Each step's send is issued before the step computes, so that the two may overlap
  (XLA's schedule decides: on 2 H200s it ran the send first, docs/DESIGN.md)."""
  held = (0, S)
  last = len(ring_pass.steps) - 1
  for step, branches in enumerate(ring_pass.steps):
    here, block_rows = block, held
    if step < last:
      held = ring_pass.keys_held(step + 1, S)
      lo, hi = held[0] - block_rows[0], held[1] - block_rows[0]
      block = ring.shift(tuple(_rows(x, ring.config.layout(slot), lo, hi - lo)
                               for x, slot in zip(block, slots)), ring_pass.direction)
    yield step, branches, here, block_rows


def _step_call(ring: Ring, ring_pass: Pass, step: int, branches: Branches, compute, idle, block,
               slots: tuple[str, ...], block_rows: Span):
  """compute(task, src, k rows, v rows, key id rows...) for this device's branch at the step
  (src: the device whose block it is), or idle()."""
  src = (lax.axis_index(ring.axis_name) - ring_pass.direction * step) % ring.size

  def task_call(task: Task, *arrays):
    rows = lambda x, slot: _rows(x, ring.config.layout(slot), task.k0 - block_rows[0], task.tk)
    return compute(task, src, *(rows(x, slot) for x, slot in zip(arrays, slots)))
  return ring.run(step, ring_pass.direction, branches, task_call, idle, *block)


def _travelling(k, v, operands: dict) -> tuple[tuple, tuple[str, ...]]:
  """The arrays that travel round the ring with the key rows, and their slots."""
  if "kv_segment_ids" in operands:
    return (k, v, operands["kv_segment_ids"]), ("k", "v", "kv_segment_ids")
  return (k, v), ("k", "v")


def forward(q, k, v, ring: Ring, scale=None, operands: dict | None = None):
  """This device's (o in float32, lse) over the whole ring; `scale`: the scale operand of a
  traced scale (Flag.SCALE_OPERAND), None for a static one; `operands`: this device's of
  RING_OPERANDS by slot (its blocks of the segment ids, the whole lengths, the seed words),
  those present. With dropout a task may be several kernel calls (Ring.calls), merged as the
  steps are."""
  config = ring.config.replace(flags=ring.config.flags | Flag.OUTPUT_F32)
  T, S = config.seq_dims[:2]
  o_layout, lse_layout = config.layout("o"), config.layout("lse")
  operands = operands or {}
  o = lse = None
  for ring_pass in ring.passes():
    own, slots = _travelling(k, v, operands)
    for step, branches, block, block_rows in _travel(ring, ring_pass, own, slots, S):
      if branches == (None, None):
        continue
      lo, hi = span = ring_pass.query_span(step)

      def compute(task: Task, src, k_rows, v_rows, *kv_ids):
        part = None
        for call, place in ring.calls(task, src):
          keys = lambda x, slot: _rows(x, config.layout(slot), call.k0 - task.k0, call.tk)
          present = ring.task_operands(call, src, operands,
                                       *(keys(x, "kv_segment_ids") for x in kv_ids), place=place)
          o_call, lse_call, _workspace = kernels.forward_kernel_p.bind(
              _rows(q, config.layout("q"), call.q0, call.tq), keys(k_rows, "k"), keys(v_rows, "v"),
              *_optional_operands(q.dtype, scale, present), config=ring.task_config(call, config))
          padded = (_pad_rows(o_call, o_layout, call.q0 - lo, hi - lo, 0.0),
                    _pad_rows(lse_call, lse_layout, call.q0 - lo, hi - lo, -jnp.inf))
          part = padded if part is None else _merge(part, padded, o_layout, lse_layout)
        return part

      idle = lambda: (_zeros(o_layout, hi - lo),
                      jnp.full(shape_of(with_rows(lse_layout, hi - lo)), -jnp.inf, jnp.float32))
      o_part, lse_part = _step_call(ring, ring_pass, step, branches, compute, idle, block,
                                    slots, block_rows)
      if o is None:  # the first step: the local block, all rows (plan())
        assert span == (0, T), span
        o, lse = o_part, lse_part
        continue
      # The merge needs both operands' rows at once: slice both, merge, write both back.
      merged = _merge((_rows(o, o_layout, lo, hi - lo), _rows(lse, lse_layout, lo, hi - lo)),
                      (o_part, lse_part), o_layout, lse_layout)
      o = _update_rows(o, o_layout, span, lambda _: merged[0])
      lse = _update_rows(lse, lse_layout, span, lambda _: merged[1])
  return o, lse


def backward(q, k, v, lse, delta, d_o, ring: Ring, scale=None, centre=None,
             operands: dict | None = None):
  """(dq, dk, dv, dscale) of this device's blocks over the whole ring; ring.config is the
  backward's. With a scale operand (`scale`, as for forward), dq is the scaled query's, in float32
  (Flag.SCALE_OPERAND); dscale is the kernels' partial sums of its gradient per key row of the
  local block (Flag.HAS_DSCALE), None without that flag. `centre`: with Flag.HAS_DSCALE, the
  dscale_centre operand of the local query block (its rows' mean logits over the whole ring,
  laid out as delta), which each step's kernels read for their query rows as they read delta.
  `operands`: as for forward."""
  config = ring.config
  operands = operands or {}
  T, S = config.seq_dims[:2]
  layout = config.layout
  # The gradients of the key rows, which travel with their block: dK, dV (and dscale).
  key_slots = ("dk", "dv") + (("dscale",) if config.has(Flag.HAS_DSCALE) else ())
  dq = _zeros(layout("dq"), T)
  key_grads = tuple(_zeros(layout(slot), S) for slot in key_slots)

  def add_rows(grads, span: Span, parts):
    return tuple(_update_rows(x, layout(slot), span, lambda rows, part=part: rows + part)
                 for x, slot, part in zip(grads, key_slots, parts))

  for ring_pass in ring.passes():
    travelling = touched = None  # the key gradients of the block here (its rows `touched`)
    last = len(ring_pass.steps) - 1
    own, slots = _travelling(k, v, operands)
    for step, branches, block, block_rows in _travel(ring, ring_pass, own, slots, S):
      if branches != (None, None):
        q_lo, q_hi = q_span = ring_pass.query_span(step)
        k_lo, k_hi = k_span = ring_pass.key_span(step)

        def compute(task: Task, src, k_rows, v_rows, *kv_ids):
          parts = None
          for call, place in ring.calls(task, src):
            q_rows = lambda x, slot: _rows(x, layout(slot), call.q0, call.tq)
            keys = lambda x, slot: _rows(x, layout(slot), call.k0 - task.k0, call.tk)
            present = ring.task_operands(call, src, operands,
                                         *(keys(x, "kv_segment_ids") for x in kv_ids), place=place)
            dq_call, dk_call, dv_call, _dbias, _dalibi, dscale_call, _workspace = (
                kernels.backward_kernel_p.bind(
                    q_rows(q, "q"), keys(k_rows, "k"), keys(v_rows, "v"),
                    *_optional_operands(q.dtype, scale, present),
                    q_rows(lse, "lse"), q_rows(delta, "delta"), q_rows(d_o, "d_o"),
                    (absent("dscale_centre", jnp.float32) if centre is None else
                     q_rows(centre, "dscale_centre")),
                    absent("dalibi_centre", jnp.float32),  # no slopes (unsupported)
                    config=ring.task_config(call)))
            f32 = lambda x: x.astype(jnp.float32)
            key_parts = dict(dk=dk_call, dv=dv_call, dscale=dscale_call)
            padded = (_pad_rows(f32(dq_call), layout("dq"), call.q0 - q_lo, q_hi - q_lo, 0.0),
                      *(_pad_rows(f32(key_parts[slot]), layout(slot), call.k0 - k_lo, k_hi - k_lo,
                                  0.0) for slot in key_slots))
            parts = padded if parts is None else tuple(a + b for a, b in zip(parts, padded))
          return parts

        idle = lambda: (_zeros(layout("dq"), q_hi - q_lo),
                        *(_zeros(layout(slot), k_hi - k_lo) for slot in key_slots))
        dq_part, *key_parts = _step_call(ring, ring_pass, step, branches, compute, idle,
                                         block, slots, block_rows)
        dq = _update_rows(dq, layout("dq"), q_span, lambda rows: rows + dq_part)
        if step == 0:  # the local block's own
          key_grads = add_rows(key_grads, k_span, key_parts)
        else:
          now = ring_pass.keys_touched(step)
          grow = lambda x, slot, span: _pad_rows(x, layout(slot), span[0] - now[0],
                                                 now[1] - now[0], 0.0)
          parts = tuple(grow(x, slot, k_span) for x, slot in zip(key_parts, key_slots))
          travelling = parts if travelling is None else tuple(
              grow(x, slot, touched) + part
              for x, slot, part in zip(travelling, key_slots, parts))
          touched = now
      if step < last and travelling is not None:
        travelling = ring.shift(travelling, ring_pass.direction)  # they go with their block
    if travelling is not None:
      # The block here at the last step is the one of `last` steps back: send its gradients home.
      key_grads = add_rows(key_grads, touched,
                           ring.shift(travelling, -ring_pass.direction * last))
  if scale is None:
    dq = dq.astype(q.dtype)  # (with a scale operand it stays float32: Flag.SCALE_OPERAND)
  dk, dv, *dscale = key_grads
  return dq, dk.astype(q.dtype), dv.astype(q.dtype), (dscale[0] if dscale else None)


# ---------------------------------------------------------------- zig-zag order

def _zigzag_chunks(device, n: int):
  """The two chunks of 2n that `device` (an int, or a traced axis index) holds in the zig-zag
  order, first and second in its block: i and 2n - 1 - i."""
  return device, 2 * n - 1 - device


def _zigzag_destinations(n: int) -> tuple[list[int], list[int]]:
  """Where chunks 2i and 2i + 1 (device i's halves in the contiguous order) go."""
  home = lambda m: m if m < n else 2 * n - 1 - m
  return [home(2 * i) for i in range(n)], [home(2 * i + 1) for i in range(n)]


def to_zigzag(x, row_axis: int, axis_name: AxisName):
  """A contiguous shard (device i holds chunks 2i, 2i + 1 of 2n) to the zig-zag order's
  (device i holds chunks i and 2n - 1 - i): two collective permutes of half a shard."""
  n = lax.axis_size(axis_name)
  first_to, second_to = _zigzag_destinations(n)
  first, second = jnp.split(x, 2, axis=row_axis)
  got_first = lax.ppermute(first, axis_name, list(enumerate(first_to)))
  got_second = lax.ppermute(second, axis_name, list(enumerate(second_to)))
  # Device d's chunk d is an even chunk (a first half) when d is even.
  return _concat_in_order(lax.axis_index(axis_name) % 2 == 0, got_first, got_second, row_axis)


def _concat_in_order(a_first, a, b, axis: int):
  """[a, b] where a_first (a traced bool), else [b, a], along `axis`: one copy, where selecting
  each half by jnp.where and then concatenating wrote the block twice. (On 2 H200s, 131072
  tokens: the compiled program's memory per GPU 2.89 -> 2.77 GiB forward, 5.27 -> 5.01 GiB
  forward + backward; the time is the transfer's, unchanged.)"""
  return lax.cond(a_first, lambda a, b: jnp.concatenate([a, b], axis=axis),
                  lambda a, b: jnp.concatenate([b, a], axis=axis), a, b)


def from_zigzag(x, row_axis: int, axis_name: AxisName):
  """The inverse of to_zigzag."""
  n = lax.axis_size(axis_name)
  first_to, second_to = _zigzag_destinations(n)
  lo, hi = jnp.split(x, 2, axis=row_axis)
  # The chunk that came as a first half: lo where the device is even (to_zigzag).
  send_first, send_second = lax.cond(lax.axis_index(axis_name) % 2 == 0,
                                     lambda lo, hi: (lo, hi), lambda lo, hi: (hi, lo), lo, hi)
  inverse = lambda dest: [(d, i) for i, d in enumerate(dest)]
  first = lax.ppermute(send_first, axis_name, inverse(first_to))
  second = lax.ppermute(send_second, axis_name, inverse(second_to))
  return jnp.concatenate([first, second], axis=row_axis)


def zigzag_order(seq_len: int, num_shards: int):
  """The permutation of sequence positions that lays a sequence out in the zig-zag order over
  `num_shards` devices: ``x[:, zigzag_order(T, n)]`` sharded contiguously gives device i the
  chunks i and 2n - 1 - i. ``jnp.argsort`` of it undoes it."""
  if seq_len % (2 * num_shards):
    raise ValueError(f"jaxflash.zigzag_order: seq_len must be a multiple of 2 * num_shards = "
                     f"{2 * num_shards}, got {seq_len}")
  c = seq_len // (2 * num_shards)
  chunks = [chunk for i in range(num_shards) for chunk in _zigzag_chunks(i, num_shards)]
  return jnp.concatenate([jnp.arange(m * c, (m + 1) * c) for m in chunks])
