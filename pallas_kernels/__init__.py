"""Pallas kernels for jaxflow's hot loops.

Each kernel lives in its own file with a public jitted wrapper (shape validation ->
jax.custom_vjp -> pl.pallas_call) and a pure-jnp `*_reference` that defines its semantics.
On CPU kernels only run with interpret=True; the default CPU path uses the XLA reference.
"""
