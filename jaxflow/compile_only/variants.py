"""A ``full`` variant resolved for the ``--target`` it is compiled for: the layout rule of
:mod:`jaxflow.compile_only.resolve` applied to the experiment's config before its meshes and
programs are built, so one variant (a model and a global batch) compiles on any target.

  lm_pretrain (a ``mesh`` and a ``train`` with ``microbatches``): ``mesh`` becomes
    (data 1, fsdp F, model T) and ``train.microbatches`` the gradient-accumulation steps of
    :func:`~jaxflow.compile_only.resolve.lm_train_layout`;
  flagship (``roles`` and a ``pretrain.model``) and rl (``roles``; ``model.hf_path``'s shapes,
    else Qwen3-8B's, as its ``compile_programs`` builds them): ``roles`` becomes the trainer /
    rollout split and model widths of :func:`~jaxflow.compile_only.resolve.rl_layout`;
  flexmarl (``solver`` / ``verifier``, caps ``trainer_model`` / ``rollout_model``): the caps
    become the model degrees of :func:`~jaxflow.compile_only.resolve.marl_layout` (trainer
    rows: ``micro_inputs`` x ``group_size``; rollout rows: ``rollout_batch`` x ``group_size``;
    tokens: ``solver_tokens`` + ``verifier_tokens``, the verifier reading the solver's answer).
  dlrm_train and nestpipe (``vocab_sizes`` tables row-wise over one "data" axis): the mesh is
    already every device; :func:`~jaxflow.compile_only.resolve.table_layout` only checks the
    target holds the tables (exit 2 naming the smallest that does), and the line says so.
  bench_rollout (``serve``, one engine replica): ``serve.model_parallel`` becomes the width
    of :func:`~jaxflow.compile_only.resolve.serve_layout`.
Keys the user set (``--set roles.*``, ``--set mesh.*``, ``--set train.microbatches=...``,
``--set trainer_model`` / ``rollout_model``, ``--set serve.model_parallel``) are kept as given.
Other variants and experiments pass through unchanged (flowtrain and bench_embedding full keep
their stated meshes: not laid out by the rule yet).
"""

from __future__ import annotations

import dataclasses

from jaxflow.compile_only import resolve

#: Experiments whose full variant the rule lays out: name -> the layout kind.
RESOLVED = {"lm_pretrain": "lm", "flagship": "rl", "rl": "rl", "flexmarl": "marl",
            "dlrm_train": "table", "nestpipe": "table",
            "bench_rollout": "serve"}
#: Dense features per row of Criteo (and the synthetic Criteo-like data).
CRITEO_DENSE = 13


def _user_set(overrides, *prefixes: str) -> bool:
    keys = [o.partition("=")[0].strip() for o in overrides or ()]
    return any(k == p or k.startswith(p + ".") for k in keys for p in prefixes)


def resolve_for_target(name: str, variant: str, config, chip, n_devices: int,
                       overrides=()) -> tuple[object, str]:
    """(``config`` laid out for ``n_devices`` ``chip``s, one line saying how) for a ``full``
    variant of an experiment in :data:`RESOLVED`; otherwise (``config``, "").

    Raises:
      resolve.DoesNotFit: no layout fits; the line names the smallest target it fits.
    """
    kind = RESOLVED.get(name)
    if variant != "full" or kind is None:
        return config, ""
    if kind == "lm":
        return _lm(config, chip, n_devices, overrides)
    if kind == "serve":
        return _serve(config, chip, n_devices, overrides)
    if kind == "table":
        return _table(name, config, chip, n_devices)
    if kind == "marl":
        return _marl(config, chip, n_devices, overrides)
    return _rl(config, chip, n_devices, overrides)


def _lm(config, chip, n, overrides):
    if _user_set(overrides, "mesh", "train.microbatches"):
        return config, "layout as set (--set mesh / train.microbatches)"
    tc = config.train
    lay = resolve.lm_train_layout(resolve.ModelShape.of(config.model), tc.batch_size,
                                  tc.seq_len, chip, n)
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
    lay = resolve.rl_layout(resolve.ModelShape.of(model),
                            train_rows=rows // rl.lag, sample_rows=rows, tokens=tokens,
                            chip=chip, n_devices=n)
    roles = dataclasses.replace(config.roles, rollout_devices=lay.rollout_devices,
                                trainer_model=lay.trainer_model,
                                rollout_model=lay.rollout_model)
    est = "; ".join(f"{k} {v.text()}" for k, v in lay.estimates.items())
    text = (f"layout for {n} {chip.name}: trainer {n - lay.rollout_devices} (model "
            f"{lay.trainer_model}), rollout {lay.rollout_devices} (model {lay.rollout_model}) "
            f"(estimates: {est})")
    return dataclasses.replace(config, roles=roles), text


def _rl_model(config):
    from jaxflow.models.architectures import read_transformer_config, shipped_config

    hf = config.model.hf_path
    model = read_transformer_config(hf) if hf else shipped_config("qwen3-8b")
    return dataclasses.replace(model, param_dtype="float32")


def _marl(config, chip, n, overrides):
    if _user_set(overrides, "trainer_model", "rollout_model"):
        return config, "model degrees as set (--set trainer_model / rollout_model)"
    agents = {"solver": resolve.ModelShape.of(config.solver),
              "verifier": resolve.ModelShape.of(config.verifier)}
    lay = resolve.marl_layout(agents, train_rows=config.micro_inputs * config.group_size,
                              sample_rows=config.rollout_batch * config.group_size,
                              tokens=config.solver_tokens + config.verifier_tokens, chip=chip,
                              n_devices=n)
    est = "; ".join(f"{k} {v.text()}" for k, v in lay.estimates.items())
    text = (f"layout for {n} {chip.name}: trainers {n - lay.rollout_devices} (model "
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
