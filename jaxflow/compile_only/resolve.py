"""How a full variant is laid out on a target: a pure rule from (model, global batch, chip,
device count) to the mesh, the role split, the model-parallel widths and gradient accumulation,
with the per-device HBM estimate it rests on. Nothing is compiled; the rule is what
``--compile-only`` applies to a ``full`` variant before building its programs
(:func:`jaxflow.compile_only.variants.resolve_for_target`).

The estimate (:class:`HbmEstimate`, bytes per device) counts
  params + optimizer: the training state (weights, gradients, AdamW's two f32 moments) or the
    sampler's weights (a serving replica's bf16; an RL sampler's published f32 params, plus the
    bf16 copy a static sampler casts them to: :func:`rl_sampler_weight_bytes`), divided by the
    devices its weights are sharded over (an RL sampler's rows are split over the "data"
    replicas of the static sampler; the paged engine is one replica whose page pool holds every
    row's KV on each "model" shard: rl full's engine compiled for v5p:4x4x4 at model 1 needed
    320 GiB per device, its 1,024 rows x 2,048 tokens of KV unsplit);
  activations: with remat per block, every block's input saved ([rows, tokens, d_model] in the
    compute dtype), one block recomputed (its q/k/v/o and SwiGLU tensors) and the f32 logits
    and their gradient ([rows, tokens, vocab / model]; none for a fused loss); a sampler's KV.
Training activations count :data:`TRAIN_SLACK` times for XLA's temporaries (Llama-3-8B, 4 x
4,096 tokens per v5p chip, layers unrolled: 46.6 GiB compiled, 24.9 estimated; scanned with a
fused loss: 14.1); a sampler's KV cache is allocated as estimated. A layout is taken when
params + optimizer + slack x activations is at most :data:`HEADROOM` of the chip's HBM.

The rule, per system (:func:`lm_train_layout`, :func:`rl_layout`, and as named below):
  LM training: ZeRO-3 / FSDP over every device (``mesh = (data 1, fsdp N, model 1)``), the
    global batch split over them; then the fewest micro-batches (gradient accumulation, a
    divisor of the per-device rows) whose estimate fits. A batch smaller than the device count
    moves the surplus to tensor parallelism ("model", dividing the heads).
  RL (trainer + sampler on disjoint halves): each role gets N/2 devices ("data" x "model") and
    the smallest power-of-2 model width (dividing the role's devices and the KV heads) whose
    estimate fits; the trainer's rows are the mini-batch (one policy-lag step), the sampler's
    the whole rollout. When the trainer fits at no width, at the widest one it then takes the
    fewest micro-batches M (gradient accumulation inside the update, ``rl.microbatches``; a
    divisor of its per-device rows) whose estimate fits, counting the f32 gradient sum the
    accumulation carries on top of the state. Used for flagship and rl full (Qwen3-8B GRPO:
    rows = prompts x group, the trainer's a 1 / lag mini-batch; rl's tokens are its prompt and
    response budgets). Per system, today (tests/test_target_resolve.py): on v5p:4x4x4 both
    fit without accumulation (M = 1, trainer model 2; rollout model 1 for flagship's static
    sampler, 4 for rl's engine); on v6e:16x16 flagship fits (trainer model 8, rollout model 2)
    and rl exits 2 on its engine (1,024 rows' KV cache on every shard, even at model 8); on
    8 x H200 flagship fits at trainer model 2, M = 1, and rl (2,048 tokens) at trainer model 4,
    M = 4 and rollout model 4; on 8 x H100 flagship takes trainer model 4 and M = 4 (128 rows
    of 1,032 tokens, 32 per micro-batch) and rollout model 2, and rl exits 2 on its engine.
  MARL (:func:`marl_layout`, flexmarl full: several agents): the rollout role gets N/2 devices
    (every agent's sampler on them, their estimates summed), the trainer devices are split over
    the agents as :func:`jaxflow.marl.meshes.agent_centric_meshes` splits them (in proportion to
    parameter counts, in blocks of the trainers' model degree and, on a pod slice, of whole
    hosts in id order: 8 chips on v5p:4x4x4, 32 on v6e:16x16), each trainer estimated at its
    largest program (:func:`marl_train_estimate`: the gradient sum and the bf16 weight copy on
    top of the training state); the trainer and rollout model degrees are each the smallest
    power of 2 at which every agent fits (the caps ``trainer_model`` / ``rollout_model``).
  Sharded-embedding recommenders (:func:`table_layout`, dlrm_train and nestpipe full): the mesh
    stays one "data" axis over every device, every table row-wise over it and the global batch
    split over it; the target decides only whether it fits: per device ``ceil(V / N)`` rows of
    each table (f32) and the sparse optimizer's state (row-wise Adagrad: one f32 per row; Adam:
    two per element; SGD: none), the dense model replicated with its gradients and Adam moments,
    and as activations (counted :data:`TRAIN_SLACK` times) the local batch's ids' rows and
    their gradients (local batch x ids per row x tables x dim, f32).
  Serving engine (:func:`serve_layout`, bench_rollout full): one engine replica's
    ``model_parallel`` is the smallest power of 2 (at most the devices, dividing the KV heads)
    whose sampler estimate (bf16 weights and the KV cache of every slot at full length, split
    that many ways) fits; a larger target runs one such replica per group of chips.
  FlowTrain (:func:`jaxflow.compile_only.resolve_flow.flow_layout`, flowtrain full: ViT
    encoder + LM backbone, weights TP over "model", replicated over "data"): the monolithic
    mesh is (data N / M, model M), M the smallest power of 2 (dividing N, the LM's KV and the
    ViT's heads) at which its padded step fits (both states over M, the padded and patch rows
    over N / M); the decoupled splits keep the stated encoder counts E (data parallel) whose
    encoder and backbone (N - E devices as data x M_b) fit at the smallest such M_b.
A variant no layout fits raises :class:`DoesNotFit` naming the smallest target of
:data:`CANDIDATES` it fits and the estimate that decided it.
"""

from __future__ import annotations

import dataclasses
import math

from jaxflow.errors import UserError
from pallas_kernels import targets

#: The share of a chip's HBM a layout may fill (the rest: XLA's buffers, fragmentation).
HEADROOM = 0.9
#: How many times training activations count (remat's and the backward's temporaries).
TRAIN_SLACK = 2.0
GIB = 2 ** 30
#: Targets the "smallest target it fits" is chosen from, smallest first (chips, devices).
CANDIDATES = (("gpu-h100x8", "h100", 8), ("gpu-h200x8", "h200", 8),
              ("tpu-v5p:4x4x4", "v5p", 64), ("tpu-v6e:16x16", "v6e", 256),
              ("tpu-v5p:8x8x8", "v5p", 512))


class DoesNotFit(UserError, ValueError):
    """No layout of the variant fits the target; the message names where it would."""


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What the estimate needs of a decoder: ``params`` (count), ``n_layers``, ``d_model``,
    ``d_ff``, ``vocab``, ``n_heads``, ``n_kv_heads``, ``head_dim``, ``param_bytes`` (4 f32 / 2
    bf16 master weights), ``compute_bytes`` (activations' dtype size)."""

    params: int
    n_layers: int
    d_model: int
    d_ff: int
    vocab: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    param_bytes: int = 4
    compute_bytes: int = 2

    @classmethod
    def of(cls, config) -> ModelShape:
        """From a :class:`jaxflow.models.transformer.TransformerConfig` (dense blocks)."""
        import numpy as np

        d, hd = config.d_model, config.head_dim
        attn = d * hd * (2 * config.n_heads + 2 * config.n_kv_heads)
        block = attn + 3 * d * config.d_ff + 2 * d
        embed = config.vocab_size * d * (1 if config.tie_embeddings else 2)
        return cls(params=config.n_layers * block + embed + d, n_layers=config.n_layers,
                   d_model=d, d_ff=config.d_ff, vocab=config.vocab_size,
                   n_heads=config.n_heads, n_kv_heads=config.n_kv_heads, head_dim=hd,
                   param_bytes=np.dtype(config.param_dtype).itemsize,
                   compute_bytes=np.dtype(config.dtype).itemsize)


@dataclasses.dataclass(frozen=True)
class HbmEstimate:
    """Bytes per device: ``params`` + ``optimizer`` (gradients and moments) + ``activations``
    (``total``), against the chip's ``capacity``; ``slack``: how many times the activations
    count when checking the fit (:data:`TRAIN_SLACK` for training, 1 for a KV cache)."""

    params: float
    optimizer: float
    activations: float
    capacity: int
    slack: float = 1.0

    @property
    def total(self) -> float:
        """params + optimizer + activations."""
        return self.params + self.optimizer + self.activations

    @property
    def needed(self) -> float:
        """params + optimizer + slack x activations: what the fit is checked on."""
        return self.params + self.optimizer + self.slack * self.activations

    @property
    def fits(self) -> bool:
        """Whether :attr:`needed` is within :data:`HEADROOM` of ``capacity``."""
        return self.needed <= HEADROOM * self.capacity

    def text(self) -> str:
        """"params 1.9 + optimizer 11.2 + 2 x activations 23.3 = 59.7 GiB per device of
        79.1 (<= 90%)" style."""
        slack = f"{self.slack:g} x " if self.slack != 1 else ""
        return (f"params {self.params / GIB:.1f} + optimizer {self.optimizer / GIB:.1f} + "
                f"{slack}activations {self.activations / GIB:.1f} = {self.needed / GIB:.1f} GiB "
                f"per device of {self.capacity / GIB:.1f} (<= {HEADROOM:.0%})")


def train_estimate(model: ModelShape, rows: float, tokens: int, *, shards: int, model_width: int,
                   capacity: int, fused_logprobs: bool = False,
                   grad_accumulator: bool = False) -> HbmEstimate:
    """Training step, per device: the state sharded over ``shards`` devices (weights
    ``param_bytes``, f32 gradients, AdamW's two f32 moments), ``rows`` sequences of ``tokens``
    per device (remat per block), vocab and MLP activations split ``model_width`` ways;
    ``fused_logprobs``: the loss reads the head block by block (no [rows, tokens, vocab]);
    ``grad_accumulator``: one more f32 gradient (the sum a micro-batched step carries)."""
    c = model.compute_bytes
    saved = model.n_layers * rows * tokens * model.d_model * c
    block = rows * tokens * (4 * model.d_model + 3 * model.d_ff / model_width) * 4
    logits = 0.0 if fused_logprobs else 2 * rows * tokens * model.vocab / model_width * 4
    return HbmEstimate(params=model.params * model.param_bytes / shards,
                       optimizer=model.params * (16 if grad_accumulator else 12) / shards,
                       activations=saved + block + logits, capacity=capacity, slack=TRAIN_SLACK)


def sample_estimate(model: ModelShape, rows: float, tokens: int, *, model_width: int,
                    capacity: int, weight_bytes: float = 2) -> HbmEstimate:
    """Sampler, per device: its weights (``weight_bytes`` per parameter: 2 for a bf16 replica;
    :func:`rl_sampler_weight_bytes` for an RL run's sampler) split ``model_width`` ways and the
    KV cache of ``rows`` sequences of ``tokens`` (heads split ``model_width`` ways)."""
    kv = 2 * model.n_layers * rows * tokens * model.n_kv_heads * model.head_dim * 2 / model_width
    logits = rows * model.vocab / model_width * 4 * 2
    return HbmEstimate(params=model.params * weight_bytes / model_width, optimizer=0.0,
                       activations=kv + logits, capacity=capacity)


def rl_sampler_weight_bytes(model: ModelShape, sampler: str) -> int:
    """Bytes per parameter an RL run's sampler holds: the published weights in the trainer's
    ``param_bytes`` (a one-job run publishes its f32 params), and for the static samplers
    ("static", "static_per_row") one more copy in the compute dtype, which they cast the whole
    tree to before the decode scan (flagship full on v5p:4x4x4, compiled: 30.5 GiB f32
    arguments + 25.7 GiB temporaries, 15.3 of them the bf16 copy); the paged engine casts
    layer by layer inside its scan (no copy)."""
    copy = model.compute_bytes if sampler != "engine" and model.compute_bytes < model.param_bytes else 0
    return model.param_bytes + copy


@dataclasses.dataclass(frozen=True)
class LmLayout:
    """An LM training layout: ``mesh`` {"data", "fsdp", "model"} sizes, ``microbatches`` (gradient
    accumulation steps per optimizer step), ``rows_per_device`` per micro-batch, ``estimate``."""

    mesh: dict
    microbatches: int
    rows_per_device: int
    estimate: HbmEstimate


@dataclasses.dataclass(frozen=True)
class RlLayout:
    """An RL layout: ``rollout_devices`` (the trainer has the rest), ``trainer_model`` and
    ``rollout_model`` widths, each role's ``estimates`` ({"trainer", "rollout"}) and the
    trainer's ``microbatches`` (gradient accumulation steps per update; 1: none); MARL's
    ``trainer_split``: {agent: trainer devices} (None for one trainer)."""

    rollout_devices: int
    trainer_model: int
    rollout_model: int
    estimates: dict
    microbatches: int = 1
    trainer_split: dict | None = None


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def lm_train_layout(model: ModelShape, batch: int, tokens: int, chip: targets.Chip,
                    n_devices: int, *, fused_logprobs: bool = False) -> LmLayout:
    """The LM training layout of ``batch`` sequences of ``tokens`` on ``n_devices`` ``chip``s (module
    docstring; ``fused_logprobs``: no logits counted), or DoesNotFit naming the smallest fit."""
    def lay(c, n):
        return _lm_layout(model, batch, tokens, c, n, fused_logprobs)
    found = lay(chip, n_devices)
    if isinstance(found, LmLayout):
        return found
    raise DoesNotFit(_where_it_fits(f"{batch} x {tokens} tokens do not fit", found,
                                    lambda c, n: isinstance(lay(c, n), LmLayout)))


def _lm_layout(model, batch, tokens, chip, n, fused_logprobs=False) -> LmLayout | HbmEstimate:
    width = 1
    while batch % (n // width) and width < n:  # rows cannot be split: the rest to TP
        width = next(w for w in _divisors(n) if w > width)
    if batch % (n // width) or model.n_heads % width or model.n_kv_heads % width:
        return train_estimate(model, batch / n, tokens, shards=n, model_width=1,
                              capacity=chip.hbm_bytes, fused_logprobs=fused_logprobs)
    rows = batch // (n // width)
    last = None
    for k in _divisors(rows):
        last = train_estimate(model, rows // k, tokens, shards=n, model_width=width,
                              capacity=chip.hbm_bytes, fused_logprobs=fused_logprobs)
        if last.fits:
            return LmLayout({"data": 1, "fsdp": n // width, "model": width}, k, rows // k, last)
    return last


def rl_layout(model: ModelShape, *, train_rows: int, sample_rows: int, tokens: int,
              chip: targets.Chip, n_devices: int, microbatches: int | None = None,
              sampler: str = "static") -> RlLayout:
    """The trainer / sampler split for ``model`` on ``n_devices`` ``chip``s: ``train_rows``
    sequences per trainer step (a mini-batch), ``sample_rows`` per rollout, ``tokens`` each
    (see the module docstring); DoesNotFit naming the smallest candidate that fits.
    ``microbatches``: the trainer's gradient accumulation as given (None: the fewest that fit);
    ``sampler``: ``rl.sampler`` (its weights: :func:`rl_sampler_weight_bytes`)."""
    return _layout_or_raise(
        lambda c, n: _rl_layout(model, train_rows, sample_rows, tokens, c, n, microbatches, sampler),
        train_rows, sample_rows, tokens, chip, n_devices)


def _layout_or_raise(search, train_rows: int, sample_rows: int, tokens: int,
                     chip: targets.Chip, n_devices: int) -> RlLayout:
    """``search(chip, n)``'s RlLayout on (``chip``, ``n_devices``), or DoesNotFit naming the
    role that does not fit and the smallest candidate where ``search`` finds a layout."""
    found = search(chip, n_devices)
    if isinstance(found, RlLayout):
        return found
    role, estimate = found
    raise DoesNotFit(_where_it_fits(
        f"{train_rows}-row updates, {sample_rows}-row rollouts of {tokens} tokens do not fit "
        f"the {role}", estimate, lambda c, n: isinstance(search(c, n), RlLayout)))


def _role_width(estimate, devices: int, kv_heads: int) -> tuple[int, HbmEstimate]:
    width, est = 1, estimate(1, devices)
    while not est.fits and width * 2 <= devices and devices % (width * 2) == 0 \
            and kv_heads % (width * 2) == 0:
        width *= 2
        est = estimate(width, devices)
    return width, est


def _rl_layout(model, train_rows, sample_rows, tokens, chip, n, microbatches=None, sampler="static"
               ) -> RlLayout | tuple:
    if n < 2:
        return "trainer", train_estimate(model, train_rows, tokens, shards=1, model_width=1,
                                         capacity=chip.hbm_bytes, fused_logprobs=True)
    rollout = n // 2
    trainer = n - rollout
    cap = chip.hbm_bytes

    def train(width, devices, micro=1):  # weights sharded over "model" only (replicated over "data")
        rows = max(1.0, train_rows / (devices // width))
        return train_estimate(model, rows / micro, tokens, shards=width, model_width=width,
                              capacity=cap, fused_logprobs=True, grad_accumulator=micro > 1)

    def sample(width, devices):  # the engine: one replica, every row's pages on each model shard
        rows = sample_rows if sampler == "engine" else max(1.0, sample_rows / (devices // width))
        return sample_estimate(model, rows, tokens,
                               model_width=width, capacity=cap,
                               weight_bytes=rl_sampler_weight_bytes(model, sampler))

    if microbatches is not None and microbatches > 1:  # as given: the widths at that M
        t_width, t_est = _role_width(lambda w, d: train(w, d, microbatches), trainer,
                                     model.n_kv_heads)
        micro = microbatches
    else:
        t_width, t_est = _role_width(train, trainer, model.n_kv_heads)
        micro = 1
        per_device = train_rows / (trainer // t_width)
        if not t_est.fits and microbatches is None and per_device == int(per_device):
            for k in _divisors(int(per_device))[1:]:  # the fewest micro-batches that fit
                t_est, micro = train(t_width, trainer, k), k
                if t_est.fits:
                    break
    r_width, r_est = _role_width(sample, rollout, model.n_kv_heads)
    if not t_est.fits:
        return "trainer", t_est
    if not r_est.fits:
        return "rollout", r_est
    return RlLayout(rollout, t_width, r_width, {"trainer": t_est, "rollout": r_est}, micro)


def marl_layout(agents: dict, *, train_rows: int, sample_rows: int, tokens: int | dict,
                chip: targets.Chip, n_devices: int, host_block: int = 1) -> RlLayout:
    """The MARL layout (module docstring) of ``agents`` ({name: :class:`ModelShape`}, run order)
    on ``n_devices`` ``chip``s: ``train_rows`` per trainer micro-batch, ``sample_rows`` per
    rollout call, ``tokens`` each (one count, or {name: count} per agent); ``host_block``: the
    devices of one whole-host block (:attr:`~jaxflow.compile_only.target.Target.host_block`),
    each agent's trainer devices a multiple of it; ``estimates`` keyed "trainer/NAME" and
    "rollout". DoesNotFit naming the smallest candidate that fits."""
    per_agent = tokens if isinstance(tokens, dict) else dict.fromkeys(agents, tokens)

    def search(c, n):
        block = host_block if (c.name, n) == (chip.name, n_devices) else _candidate_block(c, n)
        return _marl_layout(agents, train_rows, sample_rows, per_agent, c, n, block)

    return _layout_or_raise(search, train_rows, sample_rows, max(per_agent.values()), chip,
                            n_devices)


def _candidate_block(chip: targets.Chip, n: int) -> int:
    from jaxflow.compile_only.target import parse_target

    return next((parse_target(text).host_block for text, name, k in CANDIDATES
                 if (name, k) == (chip.name, n)), 1)


def marl_train_estimate(model: ModelShape, rows: float, tokens: int, *, model_width: int,
                        capacity: int) -> HbmEstimate:
    """A MARL trainer's ``accumulate_apply`` (last micro-batch + AdamW step) per device: :func:`train_estimate`
    with the gradient sum and the weights' compute-dtype copy, the state split ``model_width`` ways (TP only).
    flexmarl full's solver on v5p:4x4x4 at model 2 compiled (cb43e70): 96.8 GiB; this gives 87.2."""
    est = train_estimate(model, rows, tokens, shards=model_width, model_width=model_width,
                         capacity=capacity, fused_logprobs=True, grad_accumulator=True)
    copy = model.params * model.compute_bytes if model.compute_bytes < model.param_bytes else 0
    return dataclasses.replace(est, params=est.params + copy / model_width)


def split_units(loads: dict, units: int) -> dict:
    """``units`` (>= one per agent) over the agents of ``loads`` in proportion, at least one
    each, the rest by largest remainder (ties by order): what
    :func:`jaxflow.marl.balance.allocate_workers` gives the trainers (not imported: marl
    imports this package)."""
    spare = units - len(loads)
    total = float(sum(loads.values())) or 1.0
    share = {a: spare * v / total for a, v in loads.items()}
    out = {a: 1 + math.floor(share[a]) for a in loads}
    rest = units - sum(out.values())
    for a in sorted(loads, key=lambda a: -(share[a] - math.floor(share[a])))[:rest]:
        out[a] += 1
    return out


def _pow2(n: int) -> list[int]:
    return [w for w in (2 ** i for i in range(n.bit_length())) if n % w == 0]


def _marl_layout(agents, train_rows, sample_rows, tokens, chip, n, block=1
                 ) -> RlLayout | tuple:
    cap = chip.hbm_bytes
    if n - n // 2 < len(agents) * block:  # shared trainer mesh: not a production layout
        name = max(agents, key=lambda a: agents[a].params)
        return f"trainer/{name}", train_estimate(agents[name], train_rows, tokens[name], shards=1,
                                                 model_width=1, capacity=cap,
                                                 fused_logprobs=True)
    n_roll = n // 2
    n_train = n - n_roll
    kv = min(m.n_kv_heads for m in agents.values())
    trainer, worst = None, None
    for tp in (w for w in _pow2(n_train)
               if kv % w == 0 and n_train // math.lcm(w, block) >= len(agents)):
        unit = math.lcm(tp, block)
        split = split_units({a: float(m.params) for a, m in agents.items()}, n_train // unit)
        ests = {f"trainer/{a}": marl_train_estimate(m, max(1.0, train_rows * tp / (split[a] * unit)),
                                                    tokens[a], model_width=tp, capacity=cap)
                for a, m in agents.items()}
        worst = max(ests.items(), key=lambda kv_: kv_[1].needed / kv_[1].capacity)
        if worst[1].fits:
            trainer = (tp, ests, {a: split[a] * unit for a in agents})
            break
    if trainer is None:
        return worst
    rollout = None
    for w in (w for w in _pow2(n_roll) if kv % w == 0):
        parts = [sample_estimate(m, sample_rows, tokens[a], model_width=w,  # one engine replica
                                 capacity=cap, weight_bytes=rl_sampler_weight_bytes(m, "engine"))
                 for a, m in agents.items()]
        rollout = HbmEstimate(params=sum(e.params for e in parts), optimizer=0.0,
                              activations=sum(e.activations for e in parts), capacity=cap)
        if rollout.fits:
            return RlLayout(n_roll, trainer[0], w, trainer[1] | {"rollout": rollout},
                            trainer_split=trainer[2])
    return "rollout", rollout


def serve_layout(model: ModelShape, *, slots: int, tokens: int, chip: targets.Chip,
                 n_devices: int) -> tuple[int, HbmEstimate]:
    """(model-parallel width, its estimate) of one engine replica serving ``slots`` sequences
    of ``tokens`` (module docstring); DoesNotFit naming the smallest candidate that fits."""
    def layout(c, n):
        return _role_width(lambda w, _: sample_estimate(model, slots, tokens, model_width=w,
                                                        capacity=c.hbm_bytes),
                           n, model.n_kv_heads)

    width, est = layout(chip, n_devices)
    if est.fits:
        return width, est
    return _raise(f"{slots} slots of {tokens} tokens do not fit one engine", est,
                  lambda c, n: layout(c, n)[1].fits)


SPARSE_STATE = {"sgd": (0, 0), "rowwise_adagrad": (1, 0), "adam": (0, 2)}


def table_estimate(vocabs, dim: int, *, local_ids: int, dense_params: int, optimizer: str,
                   n_devices: int, capacity: int) -> HbmEstimate:
    """Per device: ``vocabs`` (rows per table) row-wise over ``n_devices`` at ``dim`` (f32) with
    ``optimizer``'s state (:data:`SPARSE_STATE`), ``dense_params`` replicated (weights,
    gradients, Adam: 16 bytes each), ``local_ids`` looked-up rows and their gradients."""
    if optimizer not in SPARSE_STATE:
        raise ValueError(f"sparse optimizer {optimizer!r}; valid: {', '.join(SPARSE_STATE)}")
    rows = sum(-(-v // n_devices) for v in vocabs)
    per_row, per_elem = SPARSE_STATE[optimizer]
    return HbmEstimate(params=rows * dim * 4 + dense_params * 4,
                       optimizer=rows * (per_row + per_elem * dim) * 4 + dense_params * 12,
                       activations=2 * local_ids * dim * 4, capacity=capacity, slack=TRAIN_SLACK)


def table_layout(vocabs, dim: int, *, batch: int, ids_per_row: int, dense_params: int,
                 optimizer: str, chip: targets.Chip, n_devices: int,
                 replicate_uneven: bool = False) -> HbmEstimate:
    """The estimate of ``batch`` rows (``ids_per_row`` ids each, all tables) on one "data" axis
    of ``n_devices`` ``chip``s (module docstring); ``replicate_uneven``: the tables are
    replicated unless every table's rows divide the devices (bench_embedding's ``jnp.take``
    baselines). DoesNotFit naming the smallest candidate that fits when it does not, or when
    ``batch`` does not split over the devices."""
    def est(c, n):
        even = not replicate_uneven or all(v % n == 0 for v in vocabs)
        return table_estimate(vocabs, dim, local_ids=-(-batch // n) * ids_per_row,
                              dense_params=dense_params, optimizer=optimizer,
                              n_devices=n if even else 1, capacity=c.hbm_bytes)

    found = est(chip, n_devices)
    if found.fits and batch % n_devices == 0:
        return found
    uneven = replicate_uneven and any(v % n_devices for v in vocabs)
    what = (f"{len(vocabs)} tables of {sum(vocabs):,} rows x {dim}, batch {batch}" +
            (f" (not divisible by {n_devices} devices)" if batch % n_devices else "") +
            (f" (replicated: not every table's rows divide {n_devices} devices)" if uneven
             else "") + " do not fit")
    return _raise(what, found, lambda c, n: batch % n == 0 and est(c, n).fits)


def _raise(what, estimate, fits):
    raise DoesNotFit(_where_it_fits(what, estimate, fits))


def _where_it_fits(what: str, estimate: HbmEstimate, fits) -> str:
    for text, name, n in CANDIDATES:
        if fits(targets.chip(name), n):
            return f"{what}: {estimate.text()}; the smallest target this estimate fits: {text}"
    return (f"{what}: {estimate.text()}; none of "
            f"{', '.join(t for t, _, _ in CANDIDATES)} fits it")
