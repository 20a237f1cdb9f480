"""The counter-based randomness of the device's sampled draws (schedules/sample_pick.py): a
32-bit hash of (seed, counter, column) through lowbias32's finaliser, so a row's draw depends on
its request's seed and its token's position only, never on the batch it ran in, and tests can
recompute it (tests/sampling_reference.py)."""

from __future__ import annotations

from tvm.script import tirx as T

DRAW = 0x80000000  # the hash input of the inverse CDF's uniform: no column is this large
MIX = (0x7FEB352D, 0x846CA68B)  # lowbias32's multipliers


@T.macro
def mix(h):
    """h[0] (a local uint32) through lowbias32's finaliser."""
    h[0] = T.bitwise_xor(h[0], T.shift_right(h[0], T.uint32(16)))
    h[0] = h[0] * T.uint32(MIX[0])
    h[0] = T.bitwise_xor(h[0], T.shift_right(h[0], T.uint32(15)))
    h[0] = h[0] * T.uint32(MIX[1])
    h[0] = T.bitwise_xor(h[0], T.shift_right(h[0], T.uint32(16)))


@T.macro
def row_key(h, ints, b):
    """h[0] = the hash of row b's (seed, counter), what every draw of its step starts from."""
    h[0] = T.reinterpret("uint32", ints[b, 2])
    mix(h)
    h[0] = T.bitwise_xor(h[0], T.reinterpret("uint32", ints[b, 1]))
    mix(h)
    h[0] = T.bitwise_xor(h[0], T.reinterpret("uint32", ints[b, 3]))
    mix(h)


def uniform(h):
    """A float32 in (0, 1) from a hash's top 24 bits."""
    top = T.Cast("float32", T.shift_right(h, T.uint32(8)))
    return (top + T.float32(0.5)) * T.float32(1.0 / (1 << 24))
