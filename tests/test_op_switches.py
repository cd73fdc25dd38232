"""ops.Ops' switches (runtime/cuda/op_switches.py OpSwitches) from the K4_* flags. No GPU."""

from __future__ import annotations

from dataclasses import fields

import pytest

from k4.runtime.cuda.op_switches import FLAG_OF, OpSwitches
from k4.runtime.flags import FLAGS, Flags


def test_every_switch_has_one_flag_of_its_own():
    names = [f.name for f in fields(OpSwitches)]
    assert sorted(FLAG_OF) == sorted(names)
    assert len(set(FLAG_OF.values())) == len(names) and set(FLAG_OF.values()) <= set(FLAGS)


def test_the_defaults_follow_the_flags_but_pdl_needs_asking_for():
    got = OpSwitches.from_flags(Flags({}))
    assert all(getattr(got, f.name) == bool(FLAGS[FLAG_OF[f.name]].default) for f in fields(OpSwitches))
    assert got == OpSwitches(pdl=True)  # the flags turn every switch on; a bare OpSwitches() launches plainly
    assert not OpSwitches().pdl


@pytest.mark.parametrize("field", [f.name for f in fields(OpSwitches)])
def test_a_flag_set_to_0_turns_its_switch_and_only_it_off(field):
    got = OpSwitches.from_flags(Flags({FLAG_OF[field]: "0"}))
    assert not getattr(got, field)
    assert all(getattr(got, f.name) for f in fields(OpSwitches) if f.name != field)
