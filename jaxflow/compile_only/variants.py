"""A ``full`` variant resolved for the ``--target`` it is compiled for: the layout rule of
:mod:`jaxflow.compile_only.resolve` applied to the experiment's config before its meshes and
programs are built, so one variant (a model and a global batch) compiles on any target.

  lm_pretrain (a ``mesh`` and a ``train`` with ``microbatches``): ``mesh`` becomes
    (data 1, fsdp F, model T) and ``train.microbatches`` the gradient-accumulation steps of
    :func:`~jaxflow.compile_only.resolve.lm_train_layout`;
  flagship (``roles`` and a ``pretrain.model``) and rl (``roles``; ``model.hf_path``'s shapes,
    else Qwen3-8B's, as its ``compile_programs`` builds them): ``roles`` becomes the trainer /
    rollout split and model widths of :func:`~jaxflow.compile_only.resolve.rl_layout`, and
    ``rl.microbatches`` its trainer's gradient accumulation (a ``--set rl.microbatches=M``
    is kept and the layout checked at that M);
  flexmarl (``solver`` / ``verifier``, caps ``trainer_model`` / ``rollout_model``): the caps
    become the model degrees of :func:`~jaxflow.compile_only.resolve.marl_layout` (trainer
    rows: ``micro_inputs`` x ``group_size``; rollout rows: ``rollout_batch`` x ``group_size``;
    tokens: each agent's own response budget, ``solver_tokens`` / ``verifier_tokens``: its
    engine's KV cache holds that and its prompt, 1,031 / 1,036 slots in flexmarl full).
  dlrm_train and nestpipe (``vocab_sizes`` tables row-wise over one "data" axis): the mesh is
    already every device; :func:`~jaxflow.compile_only.resolve.table_layout` only checks the
    target holds the tables (exit 2 naming the smallest that does), and the line says so.
  bench_rollout (``serve``, one engine replica): ``serve.model_parallel`` becomes the width
    of :func:`~jaxflow.compile_only.resolve.serve_layout`.
  bench_embedding (one "data" axis): :func:`~jaxflow.compile_only.resolve.table_layout`
    checks the target holds the tables row-wise, and the ``jnp.take`` baselines' tables, which
    are replicated where a table's rows do not divide the devices (``replicate_uneven``).
  flowtrain (a ViT encoder and an LM backbone): ``mesh`` becomes (data N / M, model M) and
    ``allocator`` the encoder counts and the backbone width of
    :func:`~jaxflow.compile_only.resolve_flow.flow_layout`, on the step's shapes of
    :func:`flow_step` (expected from ``data``, ``packing`` and ``train.batch_size``).
Keys the user set (``--set roles.*``, ``--set mesh.*``, ``--set train.microbatches=...``,
``--set rl.microbatches=...``,
``--set trainer_model`` / ``rollout_model``, ``--set serve.model_parallel``, ``--set
allocator.*`` / ``flow.encoder_devices``) are kept as given. Other variants and experiments
pass through unchanged.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from jaxflow.compile_only import resolve, resolve_flow

#: Experiments whose full variant the rule lays out: name -> the layout kind.
RESOLVED = {"lm_pretrain": "lm", "flagship": "rl", "rl": "rl", "flexmarl": "marl",
            "dlrm_train": "table", "nestpipe": "table",
            "bench_rollout": "serve", "bench_embedding": "bench_table", "flowtrain": "flow"}
#: Dense features per row of Criteo (and the synthetic Criteo-like data).
CRITEO_DENSE = 13


def _user_set(overrides, *prefixes: str) -> bool:
    keys = [o.partition("=")[0].strip() for o in overrides or ()]
    return any(k == p or k.startswith(p + ".") for k in keys for p in prefixes)


def resolve_for_target(name: str, variant: str, config, chip, n_devices: int,
                       overrides=(), host_block: int = 1) -> tuple[object, str]:
    """(``config`` laid out for ``n_devices`` ``chip``s, one line saying how) for a ``full``
    variant of an experiment in :data:`RESOLVED`; otherwise (``config``, ""). ``host_block``:
    the target's whole-host block (:attr:`~jaxflow.compile_only.target.Target.host_block`;
    MARL's trainer split is made of them).

    Raises:
      resolve.DoesNotFit: no layout fits; the line names the smallest target it fits.
    """
    kind = RESOLVED.get(name)
    if not (variant == "full" or variant.startswith("full_")) or kind is None:
        return config, ""
    if kind == "lm":
        return _lm(config, chip, n_devices, overrides)
    if kind == "serve":
        return _serve(config, chip, n_devices, overrides)
    if kind == "table":
        return _table(name, config, chip, n_devices)
    if kind == "marl":
        return _marl(config, chip, n_devices, overrides, host_block)
    if kind == "bench_table":
        return _bench_table(config, chip, n_devices)
    if kind == "flow":
        return _flow(config, chip, n_devices, overrides)
    return _rl(config, chip, n_devices, overrides)


def _lm(config, chip, n, overrides):
    if _user_set(overrides, "mesh", "train.microbatches"):
        return config, "layout as set (--set mesh / train.microbatches)"
    tc = config.train
    lay = resolve.lm_train_layout(resolve.ModelShape.of(config.model), tc.batch_size,
                                  tc.seq_len, chip, n,
                                  fused_logprobs=getattr(tc, "fused_loss", False))
    mesh = dataclasses.replace(config.mesh, axes=tuple(lay.mesh),
                               shape=tuple(lay.mesh.values()))
    train = dataclasses.replace(tc, microbatches=lay.microbatches)
    text = (f"layout for {n} {chip.name}: mesh {lay.mesh}, {lay.microbatches} micro-batch(es) "
            f"of {lay.rows_per_device} row(s) per device (estimate: {lay.estimate.text()})")
    return dataclasses.replace(config, mesh=mesh, train=train), text


def _rl(config, chip, n, overrides):
    if _user_set(overrides, "roles"):
        return config, "roles as set (--set roles.*)"
    rl = config.rl
    rows = rl.prompts_per_rollout * rl.group_size
    if hasattr(config, "pretrain"):  # flagship
        model, tokens = config.pretrain.model, config.task.max_prompt_len + rl.max_new_tokens
    else:  # rl: what jaxflow.main.rl.compile_programs compiles
        model, tokens = _rl_model(config), 2 * rl.max_new_tokens
    user_micro = _user_set(overrides, "rl.microbatches")
    lay = resolve.rl_layout(resolve.ModelShape.of(model),
                            train_rows=rows // rl.lag, sample_rows=rows, tokens=tokens,
                            chip=chip, n_devices=n,
                            microbatches=rl.microbatches if user_micro else None,
                            sampler=rl.sampler)
    roles = dataclasses.replace(config.roles, rollout_devices=lay.rollout_devices,
                                trainer_model=lay.trainer_model,
                                rollout_model=lay.rollout_model)
    est = "; ".join(f"{k} {v.text()}" for k, v in lay.estimates.items())
    # one micro-batch (no accumulation) is said only when set: the line of a layout without
    # accumulation reads as before accumulation existed (the compile matrix compares it)
    micro = ("" if lay.microbatches == 1 and not user_micro else
             f", {lay.microbatches} micro-batch(es) of {rows // rl.lag // lay.microbatches} "
             f"row(s) per update" + (" (as set)" if user_micro else ""))
    text = (f"layout for {n} {chip.name}: trainer {n - lay.rollout_devices} (model "
            f"{lay.trainer_model}{micro}), rollout {lay.rollout_devices} (model "
            f"{lay.rollout_model}) (estimates: {est})")
    rl = rl if user_micro else dataclasses.replace(rl, microbatches=lay.microbatches)
    return dataclasses.replace(config, roles=roles, rl=rl), text


def _rl_model(config):
    from jaxflow.models.architectures import read_transformer_config, shipped_config

    hf = config.model.hf_path
    model = read_transformer_config(hf) if hf else shipped_config("qwen3-8b")
    return dataclasses.replace(model, param_dtype="float32")


def _marl(config, chip, n, overrides, host_block=1):
    if _user_set(overrides, "trainer_model", "rollout_model"):
        return config, "model degrees as set (--set trainer_model / rollout_model)"
    agents = {"solver": resolve.ModelShape.of(config.solver),
              "verifier": resolve.ModelShape.of(config.verifier)}
    lay = resolve.marl_layout(agents, train_rows=config.micro_inputs * config.group_size,
                              sample_rows=config.rollout_batch * config.group_size,
                              tokens={"solver": config.solver_tokens,
                                      "verifier": config.verifier_tokens}, chip=chip,
                              n_devices=n, host_block=host_block)
    est = "; ".join(f"{k} {v.text()}" for k, v in lay.estimates.items())
    split = ", ".join(f"{a} {k}" for a, k in lay.trainer_split.items())
    text = (f"layout for {n} {chip.name}: trainers {n - lay.rollout_devices} ({split}; model "
            f"{lay.trainer_model}), rollout {lay.rollout_devices} (model {lay.rollout_model}) "
            f"(estimates: {est})")
    return dataclasses.replace(config, trainer_model=lay.trainer_model,
                               rollout_model=lay.rollout_model), text


def _mlp_params(widths) -> int:
    return sum(a * b + b for a, b in zip(widths, widths[1:]))


def _table(name, config, chip, n):
    if name == "dlrm_train":  # tables: config.data, model: config.model, optimizer: train
        vocabs, dim, mc = config.data.vocab_sizes, config.model.embed_dim, config.model
        ids, batch, opt = config.data.multi_hot, config.train.batch_size, \
            config.train.sparse_optimizer
        bottom, top = mc.bottom, mc.top
    else:  # nestpipe: flat fields, row-wise Adagrad (jaxflow.nestpipe.model.sparse_optimizer)
        vocabs, dim, ids, batch = config.vocab_sizes, config.embed_dim, config.multi_hot, \
            config.batch_size
        opt, bottom, top = "rowwise_adagrad", config.bottom, config.top
    t = len(vocabs)
    dense = _mlp_params((CRITEO_DENSE, *bottom, dim)) + \
        _mlp_params((dim + t * (t + 1) // 2, *top, 1))
    est = resolve.table_layout(vocabs, dim, batch=batch, ids_per_row=ids * t,
                               dense_params=dense, optimizer=opt, chip=chip, n_devices=n)
    return config, (f"layout for {n} {chip.name}: mesh data {n} (tables row-wise, batch "
                    f"{batch // n} per device; estimate: {est.text()})")


def _serve(config, chip, n, overrides):
    from jaxflow.models.architectures import shipped_config

    serve = config.serve
    if serve is None or _user_set(overrides, "serve.model_parallel"):
        return config, "" if serve is None else "model_parallel as set (--set serve.*)"
    layers = {} if serve.n_layers is None else {"n_layers": serve.n_layers}
    model = shipped_config(serve.model, param_dtype="bfloat16", **layers)  # the sync replica
    tokens = serve.prompt_len + serve.max_new
    width, est = resolve.serve_layout(resolve.ModelShape.of(model), slots=serve.slots,
                                      tokens=tokens, chip=chip, n_devices=n)
    text = (f"layout for {n} {chip.name}: one engine on {width} chip(s) (model {width}; "
            f"estimate: {est.text()})")
    return dataclasses.replace(config, serve=dataclasses.replace(serve, model_parallel=width)), text


def _bench_table(config, chip, n):
    vocabs = config.table_rows()
    est = resolve.table_layout(vocabs, config.dim, batch=config.batch_size,
                               ids_per_row=config.bag * config.num_tables, dense_params=0,
                               optimizer="rowwise_adagrad", chip=chip, n_devices=n,
                               replicate_uneven=True)
    return config, (f"layout for {n} {chip.name}: mesh data {n} (tables row-wise, batch "
                    f"{config.batch_size // n} per device; estimate: {est.text()})")


#: Text tokens of a FlowTrain sample, at most: BOS, the longest prompt ("which is larger?")
#: and answer (four number words, 23 characters) and EOS.
FLOW_TEXT_TOKENS = 40
#: Rows over the expected tokens' count: the step's draw and the packing's fill.
FLOW_ROW_SLACK = 1.1


def vit_shape(vit) -> resolve.ModelShape:
    """The :class:`~jaxflow.compile_only.resolve.ModelShape` of a
    :class:`jaxflow.flow.vit.ViTConfig` encoder (vocab 0: no logits): patch and grid
    embeddings, its blocks, the final norm and the two-layer projector."""
    d = vit.d_model
    block = 4 * d * d + 3 * d * vit.d_ff + 2 * d
    params = (vit.patch_size ** 2 * d + 2 * vit.max_grid * d + vit.n_layers * block + d +
              d * vit.out_dim + vit.out_dim ** 2)
    return resolve.ModelShape(params=params, n_layers=vit.n_layers, d_model=d, d_ff=vit.d_ff,
                              vocab=0, n_heads=vit.n_heads, n_kv_heads=vit.n_heads,
                              head_dim=d // vit.n_heads, param_bytes=4,
                              compute_bytes=np.dtype(vit.dtype).itemsize)


def flow_step(config) -> resolve_flow.VlmStep:
    """A flowtrain step's shapes, expected from ``config.data``'s task, image-count and size
    weights (:class:`jaxflow.flow.digits_data.DigitsConfig`; tasks caption, count, sum,
    compare, text): padded rows as long as the longest sample (4 images of the largest size),
    packed rows and patch rows :data:`FLOW_ROW_SLACK` times the expected tokens / patches."""
    data, batch = config.data, config.train.batch_size
    patches = [(s // data.patch_size) ** 2 for s in data.sizes]
    per_image = sum(w * p for w, p in zip(data.size_weights, patches)) / sum(data.size_weights)
    w = data.images_weights
    any_count = sum(k * x for k, x in enumerate(w, 1)) / sum(w)
    two_plus = sum(k * x for k, x in enumerate(w, 1) if k > 1) / sum(w[1:])
    caption, count, summed, compare, _ = data.task_weights
    images = ((caption + count) * any_count + summed * two_plus + 2 * compare) / \
        sum(data.task_weights)
    image_tokens = batch * images * per_image
    g, budget = config.packing.row_granularity, config.packing.token_budget
    return resolve_flow.VlmStep(
        samples=batch, padded_len=-(-(4 * max(patches) + FLOW_TEXT_TOKENS) // g) * g,
        packed_rows=math.ceil(FLOW_ROW_SLACK * (image_tokens + batch * FLOW_TEXT_TOKENS) / budget),
        packed_len=budget, patch_rows=math.ceil(FLOW_ROW_SLACK * image_tokens / config.vit.row_len),
        patch_len=config.vit.row_len)


def _flow(config, chip, n, overrides):
    if _user_set(overrides, "mesh", "allocator", "flow.encoder_devices"):
        return config, "layout as set (--set mesh / allocator / flow.encoder_devices)"
    lay = resolve_flow.flow_layout(vit_shape(config.vit), resolve.ModelShape.of(config.model),
                              flow_step(config), encoder_counts=config.allocator.encoder_candidates,
                              chip=chip, n_devices=n)
    m, mb = lay.monolithic_model, lay.backbone_model
    mesh = dataclasses.replace(config.mesh, axes=("data", "model"), shape=(n // m, m))
    allocator = dataclasses.replace(config.allocator, encoder_candidates=lay.encoder_counts,
                                    backbone_model_degrees=(mb,))
    splits = ", ".join(f"{e} + {(n - e) // mb}x{mb}" for e in lay.encoder_counts)
    est = "; ".join(f"{k} {v.text()}" for k, v in lay.estimates.items())
    text = (f"layout for {n} {chip.name}: monolithic mesh {n // m}x{m} (data x model), "
            f"decoupled splits {splits} (estimates: {est})")
    return dataclasses.replace(config, mesh=mesh, allocator=allocator), text
