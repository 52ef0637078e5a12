"""What the checker's and the parser's tests of hostile input share: the hypothesis
settings of their fuzzers and the smallest module they edit."""

from __future__ import annotations

from hypothesis import HealthCheck, settings

FUZZ = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

SUM = """\
fcir.module @p ir_version=1 placements=[clients:3]
func @main(%0: {f32[4]}@clients) -> (f32[]@server) {
  %1: f32[4]@server = fed.sum %0
  %2: f32[]@server = jax.reduce_sum %1 {axes=[0], out_sharding=none}
  return %2
}
"""
