# ruff: noqa: E402
# title: compile-only for a TPU topology
# %% [markdown]
# # Compile a train step for a TPU slice you do not have
#
# With `libtpu` installed (the `aot` extra), XLA's real TPU compiler compiles programs for
# abstract TPU chips on a CPU-only machine: nothing is allocated or run. The compiled program
# tells you, before booking the slice, whether it fits the chip's HBM, its FLOPs and bytes,
# its collectives and a roofline time. Here: a small LM train step on a TPU v5e 2x2 slice
# (4 chips), data x tensor parallel.

# %% [markdown]
# This notebook needs `libtpu` (run it in the compile environment, e.g. `.venv-aot`). Without it
# the target list below is empty, this cell says so, and every later cell does nothing.

# %%
import importlib.util
import os

from IPython.display import Markdown, display

from pallas_kernels.targets import compile_env

# before JAX starts: let the CUDA plugin (if any) load without a GPU, no backend is needed
os.environ.update(compile_env())
import jax

jax.config.update("jax_platforms", os.environ["JAX_PLATFORMS"])

HAVE_LIBTPU = importlib.util.find_spec("libtpu") is not None
TARGETS = ["tpu-v5e:2x2"] if HAVE_LIBTPU else []
if not HAVE_LIBTPU:
    display(Markdown("**Skipped:** `libtpu` is not installed in this kernel's environment, so there "
                     "is no TPU compiler to call. Install the `aot` extra (`pip install -e \".[aot]\"`) "
                     "or run this notebook in `.venv-aot`."))

# %%
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxflow.compile_only import Program, count_params, transformer_train_flops
from jaxflow.compile_only.compile import compile_program
from jaxflow.compile_only.report import table
from jaxflow.compile_only.target import parse_target
from jaxflow.mesh import make_mesh
from jaxflow.models import TransformerConfig
from jaxflow.train.lm_state import lm_functions, make_train_step
from jaxflow.train.state import TrainState

# %% [markdown]
# The program: the library's LM train step (`make_train_step`), built for a mesh and described
# by abstract arguments (`jax.ShapeDtypeStruct` with shardings), so no parameter is ever
# created. `Program` also carries the analytic FLOPs, for the roofline MFU bound and the MFU estimate.

# %%
cfg = TransformerConfig(vocab_size=1024, d_model=256, n_layers=2, n_heads=8, n_kv_heads=4, d_ff=1024,
                        max_seq_len=256)
BATCH, SEQ = 16, 256


def train_step_program(mesh) -> Program:
    fns = lm_functions(cfg, mesh)  # param shardings from the logical-axis rules
    tx = optax.adamw(1e-3)
    params = fns.abstract_params()
    shardings = TrainState.shardings(tx, params, fns.param_shardings)
    rows = NamedSharding(mesh, P("data"))
    step = make_train_step(fns, tx, shardings, rows)
    state = TrainState.abstract(tx, params, fns.param_shardings)
    batch = {k: jax.ShapeDtypeStruct((BATCH, SEQ), jnp.int32, sharding=rows)
             for k in ("tokens", "targets", "loss_mask", "segment_ids", "positions")}
    flops = transformer_train_flops(count_params(params), BATCH * SEQ, n_layers=cfg.n_layers, seq_len=SEQ,
                                    d_attn=cfg.n_heads * cfg.head_dim)
    return Program("train/step", step, (state, batch), mesh, kind="train", model_flops=flops,
                   tokens=BATCH * SEQ, note="data 2 x model 2")

# %% [markdown]
# For each target: its abstract devices (from libtpu), a mesh over them, and the compile.
# `compile_program` never raises for a program that does not fit: its entry says so.

# %%
entries = []
for text in TARGETS:
    target = parse_target(text)
    devices = target.devices()
    print(text, "->", len(devices), "x", devices[0].device_kind)
    mesh = make_mesh({"data": 2, "model": 2}, devices=devices)
    entries.append(compile_program(train_step_program(mesh), target.chip))
if entries:
    print(table(entries))

# %% [markdown]
# The same for a whole experiment from the command line (it compiles every program the run
# would execute and writes `compile_report.json`):
# `.venv-aot/bin/python -m jaxflow.run --exp=lm_pretrain --variant=quick --compile-only --target=tpu-v5e:2x2`
#
# Checks: the step compiled for the TPU, fits a v5e chip's 16 GiB of HBM, and the gradient
# reduction over the data axis shows up as a collective in the compiled program.

# %%
for entry in entries:
    print(entry["name"], entry["status"], entry["memory"]["total_bytes"], "bytes per chip;",
          "collectives:", entry["collectives"])
    assert entry["status"] == "ok" and entry["memory"]["fits"], entry.get("error")
    assert entry["memory"]["total_bytes"] < entry["memory"]["capacity_bytes"]
    assert entry["collective_bytes"] > 0
    assert entry["roofline_mfu_bound"] is not None and entry["mfu_estimate"] is not None
