"""FlowTrain's jitted programs with abstract arguments, for ``--compile-only``.

On the monolithic mesh: the encoder / backbone inits (params and optimizer state created in
place), the monolithic step on padded and on packed rows, and held-out evaluation; per candidate
split of the allocator, the decoupled programs: encoder forward (its vjp residuals feed the
update in the shardings its compile gives them), encoder update, backbone step. Every program
is the one the run executes, built by ``jaxflow.flow.steps`` / ``jaxflow.flow.vlm`` on
:class:`~jaxflow.flow.steps.Sides`; the shapes are those of one step's samples.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

from jaxflow.compile_only.program import Program, compile_ahead, mesh_note, transformer_train_flops
from jaxflow.flow.batching import (
    PackingConfig,
    encoder_image_base,
    encoder_patches,
    eval_layout,
    layout_rows,
    pooled_image_base,
)
from jaxflow.flow.decoupled import BUFFER_GRANULARITY, abstract_replicated, abstract_rows
from jaxflow.flow.packing import CostModel
from jaxflow.flow.steps import (
    Sides,
    make_backbone_step,
    make_encoder_fns,
    make_eval_step,
    make_monolithic_step,
)
from jaxflow.flow.vit import ViTEncoder
from jaxflow.flow.vlm import abstract_side_state, bucket, make_side_init
from jaxflow.models.transformer import Transformer, param_count

_TP = "TP over heads / mlp / vocab"
_DP = "weights replicated"


def step_flops(sides: Sides, samples: Sequence) -> tuple[float, float]:
    """(encoder, backbone) training FLOPs of one step on ``samples``, padding not counted:
    the backbone's ``transformer_train_flops`` (embedding gather excluded; tokens attend within
    their sample) and the ViT's 6 x params x patches + 12 x layers x width x sum(patches^2)
    (bidirectional attention)."""
    lm, vit = sides.lm, sides.vit
    n_enc, n_bb = param_count(sides.enc.abstract_params()), param_count(sides.bb.abstract_params())
    tokens = sum(s.length for s in samples)
    bb = transformer_train_flops(n_bb - lm.vocab_size * lm.d_model, tokens,
                                 n_layers=lm.n_layers,
                                 seq_len=sum(s.length**2 for s in samples) / max(tokens, 1),
                                 d_attn=lm.n_heads * lm.head_dim)
    patches = sum(s.n_image_tokens for s in samples)
    enc = 6.0 * n_enc * patches + 12.0 * vit.n_layers * vit.d_model * sum(
        n**2 for s in samples for n in s.image_tokens)
    return enc, bb


def _key(mesh) -> jax.ShapeDtypeStruct:
    dtype = jax.eval_shape(lambda: jax.random.key(0)).dtype
    return jax.ShapeDtypeStruct((), dtype, sharding=abstract_replicated((), np.float32,
                                                                        mesh).sharding)


def monolithic_programs(sides: Sides, samples: Sequence, held: Sequence, packing: PackingConfig,
                        cost: CostModel) -> list[Program]:
    """On ``sides``' one mesh (encoder and backbone colocated): ``init/encoder``,
    ``init/backbone``, ``monolithic_padded/step``, ``monolithic_packed/step`` on ``samples`` and
    ``eval`` on the ``held`` samples."""
    mono = sides.bb.mesh
    words = mesh_note(mono, _TP, _DP) + ", ViT and LM alike"
    inits = (("encoder", sides.enc, sides.enc_tx, lambda r: ViTEncoder(sides.vit, rngs=r)),
             ("backbone", sides.bb, sides.bb_tx, lambda r: Transformer(sides.lm, rngs=r)))
    programs = [Program(f"init/{side}", make_side_init(fns, factory, tx), (_key(mono),), mono,
                        "forward", note=f"params + AdamW state created in place, {words}")
                for side, fns, tx, factory in inits]
    enc_state, bb_state = (abstract_side_state(sides.enc, sides.enc_tx),
                           abstract_side_state(sides.bb, sides.bb_tx))
    rows, denom = mono.shape["data"], abstract_replicated((), np.float32, mono)
    patches = encoder_patches(samples, sides.vit, rows)
    flops = sum(step_flops(sides, samples))
    tokens = sum(s.length for s in samples)
    for layout in ("padded", "packed"):
        lay = layout_rows(samples, layout, encoder_image_base(samples, patches), packing=packing,
                          cost=cost, row_multiple=rows)
        r, t = lay.rows["tokens"].shape
        programs.append(Program(
            f"monolithic_{layout}/step", make_monolithic_step(sides),
            (enc_state, bb_state, abstract_rows(patches.arrays(), mono),
             abstract_rows(lay.rows, mono), denom), mono, "train", model_flops=flops,
            tokens=tokens,
            note=f"{words}; {len(samples)} samples as {r} {layout} rows of {t} tokens, "
                 f"{patches.patches.shape[0]} patch rows of {sides.vit.row_len}"))
    held_patches, held_lay = eval_layout(held, sides.vit, rows, cost)
    programs.append(Program(
        "eval", make_eval_step(sides),
        (sides.enc.abstract_params(), sides.bb.abstract_params(),
         abstract_rows(held_patches.arrays(), mono), abstract_rows(held_lay.rows, mono)),
        mono, "forward", tokens=sum(s.length for s in held),
        note=f"{words}; {len(held)} held-out samples, padded rows "
             f"{'x'.join(map(str, held_lay.rows['tokens'].shape))}"))
    return programs


def split_programs(sides: Sides, split: str, samples: Sequence, packing: PackingConfig,
                   cost: CostModel) -> list[Program]:
    """The decoupled programs of one candidate split ``split`` ("E(..)+B(..)", what the
    allocator profiles and the decoupled trainer runs) on ``sides``' two meshes:
    ``encoder/SPLIT/forward``, ``encoder/SPLIT/update``, ``backbone/SPLIT/step``."""
    enc_mesh, bb_mesh = sides.enc.mesh, sides.bb.mesh
    encode, update = make_encoder_fns(sides)
    enc_flops, bb_flops = step_flops(sides, samples)
    n_patches, tokens = sum(s.n_image_tokens for s in samples), sum(s.length for s in samples)
    patches = encoder_patches(samples, sides.vit, enc_mesh.shape.get("data", 1))
    enc_words = (f"{mesh_note(enc_mesh, _TP, _DP)}, {patches.patches.shape[0]} patch rows of "
                 f"{sides.vit.row_len}")
    forward, (flat, vjp_fn) = compile_ahead(Program(
        f"encoder/{split}/forward", encode,
        (sides.enc.abstract_params(), abstract_rows(patches.arrays(), enc_mesh)), enc_mesh,
        "forward", model_flops=enc_flops / 3, tokens=n_patches, note=enc_words))
    base, _ = pooled_image_base(samples)
    layout = layout_rows(samples, "packed", base, packing=packing, cost=cost,
                         row_multiple=bb_mesh.shape.get("data", 1))
    buffer = abstract_replicated((bucket(max(n_patches, 1), BUFFER_GRANULARITY),
                                  sides.lm.d_model), np.float32, bb_mesh)
    r, t = layout.rows["tokens"].shape
    return [
        forward,
        Program(f"encoder/{split}/update", update,
                (abstract_side_state(sides.enc, sides.enc_tx), vjp_fn,
                 abstract_replicated(flat.shape, np.float32, enc_mesh)),
                enc_mesh, "train", model_flops=2 * enc_flops / 3, tokens=n_patches,
                note=enc_words + "; vjp residuals as the forward leaves them"),
        Program(f"backbone/{split}/step", make_backbone_step(sides),
                (abstract_side_state(sides.bb, sides.bb_tx), buffer,
                 abstract_rows(layout.rows, bb_mesh), abstract_replicated((), np.float32, bb_mesh)),
                bb_mesh, "train", model_flops=bb_flops, tokens=tokens,
                note=f"{mesh_note(bb_mesh, _TP, _DP)}; {r} packed rows of {t} tokens; "
                     f"image-embedding buffer {buffer.shape} replicated")]
