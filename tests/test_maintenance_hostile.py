"""The maintenance commands (``info``, ``verify``, ``verify --repair``, ``upgrade``, ``convert``,
``unlock``) against damaged buffers, bad arguments and other processes, as a user or an attacker
would run them: a message and an exit status, never a traceback, and nothing committed lost."""

from __future__ import annotations

import pytest

from replaybuf.cli import main

from .test_maintenance import filled


def run_cli(argv) -> int:
    return main([str(a) for a in argv])


@pytest.mark.parametrize(
    ("backend", "name"),
    [("memmap", "reward.data.npy"), ("memmap", "replaybuf/checksums.npy"), ("hdf5", "replaybuf/checksums.npy")],
)
@pytest.mark.parametrize("command", ["info", "verify"])
def test_a_npy_header_whose_quote_became_a_comment_is_damage_not_a_traceback(tmp_path, capsys, backend, name, command):
    # "{'descr': ..." with its quote flipped to '#' comments out the rest of the header: numpy's
    # parse raises tokenize.TokenError, which is neither ValueError nor SyntaxError
    filled(tmp_path / "b", backend)
    path = tmp_path / "b" / name
    header = bytearray(path.read_bytes())
    assert header[20:21] == b"'"
    header[20] = ord("#")
    path.write_bytes(bytes(header))
    assert run_cli([command, tmp_path / "b"]) == 1
    err = capsys.readouterr().err
    assert str(path) in err and "not a readable" in err
