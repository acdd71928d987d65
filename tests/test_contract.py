"""Python's copy of the C++ contract (jaxflash/contract.py) equals the extension's own constants
(cuda/params.h, cuda/ffi/decode.h), as the installed extension reports them: a flag bit, dtype
code or slot changed on one side only fails here, not as wrong numbers in a kernel."""

from __future__ import annotations

import pytest

from jaxflash import contract, kernels

CONSTANTS = ("dtype_codes", "slots", "max_instance_dims", "unbounded", "cuda_max_seqlen",  # contract.NAME.upper()
             "dropout_resolution")


@pytest.fixture(scope="module")
def native() -> dict:
  return kernels._native.contract()


def test_flag_bits(native):
  assert {flag.name: flag.value for flag in contract.Flag} == native["flags"]


@pytest.mark.parametrize("name", CONSTANTS)
def test_constant(name, native):
  assert getattr(contract, name.upper()) == native[name]


def test_every_native_constant_is_checked(native):
  assert set(native) == {"flags", *CONSTANTS}
