"""L6: a JAX engine with Levanter-style device state, ragged paged attention and a Pallas TPU kernel."""
