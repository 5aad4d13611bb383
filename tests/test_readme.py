"""replaybuf's own README, run as a newcomer pastes it: its Python blocks are read from README.md
(not copied) and executed in order in one namespace, in a temporary folder.

Only what cannot run offline is changed: object-store URLs become local folders (made here with
the fields the block uses), and the prioritized-replay lines, which need a priority field the
first example does not have, are run on a buffer that has one. The rate-limited block waits for
a writer and the custom-backend block is a pytest class: both are covered by their own tests.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from replaybuf import ReplayBuffer

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> dict[str, str]:
    """The README's Python blocks keyed by the heading above each (a second one under the same
    heading gets ``#2``)."""
    blocks: dict[str, str] = {}
    heading = ""
    pattern = r"^#{1,6} ([^\n]+)$|^```python\n(.*?)^```|^```\w*\n.*?^```"  # headings, Python, other blocks
    for match in re.finditer(pattern, README.read_text(), re.M | re.S):
        if match[1] is not None:
            heading = match[1].strip()
        elif match[2] is not None:
            name = heading if heading not in blocks else f"{heading}#2"
            blocks[name] = match[2]
    return blocks


def run(code: str, namespace: dict, label: str) -> None:
    exec(compile(code, f"<README {label}>", "exec"), namespace)


def test_the_readme_python_blocks_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MPLBACKEND", "Agg")
    blocks = python_blocks()
    namespace: dict = {}

    run(blocks["Use"], namespace, "Use")
    assert namespace["again"].num_episodes == 2 and namespace["all_data"]["state"].shape == (2, 100, 3, 16, 16)

    reading = blocks["Reading back"]
    prioritized = reading.index("loader = buffer.dataloader(batch_size = 256, timestep_level = True,       # prior")
    run(reading[:prioritized], namespace, "Reading back")
    with_priority = ReplayBuffer(
        "prioritized", max_episodes=4, max_timesteps=10, fields={"state": "float", "priority": ("float", (), 1.0)}
    )
    with_priority.store_episode(state=np.arange(10, dtype=np.float32))
    update = reading.index("buffer.update_priorities(")
    scope = {**namespace, "buffer": with_priority}
    run(reading[prioritized:update], scope, "Reading back (prioritized)")
    run("batch = next(iter(loader)); new_priorities = torch.full((256,), 2.0)", scope, "a training step")
    run(reading[update:], scope, "Reading back (update_priorities)")
    assert (with_priority.data["priority"][0, :10] == 2.0).all()

    for name, count in (("demos", 3), ("play", 2), ("sim", 2)):
        member = ReplayBuffer(
            name, max_episodes=4, max_timesteps=5, fields={"state": "float"}, meta_fields={"success": "bool"}
        )
        for i in range(count):
            member.store_episode(state=np.full(5, i, np.float32), success=i % 2 == 0)
        member.close()
    mixture = blocks["Weighted mixtures"].replace("'s3://bucket/play'", "'play'")
    run(mixture, namespace, "Weighted mixtures")
    assert next(iter(namespace["loader"]))["state"].shape == (256,)

    analysis = blocks["Analysis with dask"].replace("'s3://my-bucket/demos'", "'./replay_data'")
    reader = dict(namespace)  # its `buffer` is a read-only one: the writer's blocks go on with theirs
    run(analysis.replace("{'endpoint_url': 'https://s3.example.com'}", "None"), reader, "Analysis with dask")
    assert reader["returns"].shape == (2,) and reader["obs_mean"].shape == (3, 16, 16)

    for name in ("a", "b"):
        ReplayBuffer(name, max_episodes=2, max_timesteps=5, fields={"state": ("float", (3, 16, 16))}).store_episode(
            state=np.ones((5, 3, 16, 16), np.float32)
        )
    run(blocks["Statistics: exact or from sketches"], namespace, "Statistics")
    assert namespace["back"].shape == namespace["batch"]["action"].shape

    run(blocks["Named snapshots"], namespace, "Named snapshots")
    assert namespace["buffer"].snapshots() == []


def bash_block(heading: str) -> list[str]:
    """The command lines of the README's bash block under ``heading``, without their comments."""
    text = README.read_text()
    block = re.search(rf"^#+ {re.escape(heading)}\n.*?^```bash\n(.*?)^```", text, re.M | re.S)
    assert block is not None, heading
    return [line.split("  #", 1)[0].strip() for line in block[1].splitlines() if line.strip()]


def test_the_migration_blocks_run_on_the_seeds_folders(tmp_path, monkeypatch):
    """The Python block (after "Use": only ``ReplayBuffer`` is bound) on folders the seed
    memmap-replay-buffer 0.2.3 wrote, then its command lines as a shell runs them; the one on an
    object store names a local buffer instead, and ``./old_run`` is a buffer of format 1."""
    import shlex
    import shutil

    import memmap_replay_buffer as seed

    from replaybuf.cli import main

    monkeypatch.chdir(tmp_path)
    args = dict(max_episodes=3, max_timesteps=4, fields={"state": ("float", 2)})
    for seed_cls, folder in ((seed.ReplayBuffer, "replay_data"), (seed.ReplayBufferH5PY, "h5_data")):
        written = seed_cls(folder, **args)
        written.store_episode(state=np.ones((4, 2), np.float32))
    shutil.copytree(README.parent / "tests" / "data" / "format-v1" / "zarr", "old_run")

    namespace = {"ReplayBuffer": ReplayBuffer}  # what the blocks before bound; not `replaybuf`
    run(python_blocks()["Migrating from memmap-replay-buffer"], namespace, "Migrating")
    assert ReplayBuffer.from_folder("h5_new", read_only=True).num_episodes == 1

    for line in bash_block("Migrating from memmap-replay-buffer"):
        argv = shlex.split(line.replace("s3://bucket/run1", "./replay_zarr"))
        assert argv[0] == "replaybuf" and main(argv[1:]) in (0, None), line
    assert ReplayBuffer.from_folder("replay_zarr", read_only=True).num_episodes == 1


def test_the_import_and_export_command_lines_run(tmp_path, monkeypatch):
    """The command lines of "Importing and exporting" as a shell runs them, on small sources of
    each format made here under the README's names; Minari's names a dataset id to download, and
    is left to tests/test_importers.py. ``[--video]`` runs as written without it."""
    import shlex

    import h5py

    from replaybuf.cli import main

    from ._lerobot_fixture import write_lerobot
    from .test_importers import write_diffusion_policy, write_robomimic

    monkeypatch.chdir(tmp_path)
    rng = np.random.default_rng(0)
    write_diffusion_policy(
        "pusht.zarr",
        {"img": rng.integers(0, 255, (12, 8, 8, 3), dtype=np.uint8), "state": rng.normal(size=(12, 2))},
        ends=[4, 9, 12],
    )
    write_robomimic("demo.hdf5")
    with h5py.File("hopper-medium-v2.hdf5", "w") as f:
        for name, value in {
            "observations": rng.normal(size=(8, 3)),
            "actions": rng.normal(size=(8, 2)),
            "rewards": rng.normal(size=8),
            "terminals": np.arange(8) == 3,
            "timeouts": np.zeros(8, bool),
        }.items():
            f.create_dataset(name, data=value)
    write_lerobot(tmp_path / "lerobot" / "pusht", video=False)

    lines = bash_block("Importing and exporting")
    assert sum("replaybuf import minari" in line for line in lines) == 1
    for line in lines:
        if "replaybuf import minari" in line:
            continue
        argv = shlex.split(line.replace("[--video]", ""))
        assert argv[0] == "replaybuf" and main(argv[1:]) in (0, None), line
    assert ReplayBuffer.from_folder("pusht", read_only=True).num_episodes == 3
    assert ReplayBuffer.from_folder("hopper", read_only=True).num_episodes == 2
    assert (tmp_path / "pusht-out.zarr" / "meta" / "episode_ends").exists()
    assert (tmp_path / "pusht-lerobot" / "meta" / "info.json").exists()


def test_every_python_block_is_accounted_for():
    """A new README block must be run above or listed here with the test that covers it."""
    covered_elsewhere = {
        "Rate-limited sampling (online RL)": "tests/test_ratelimit.py",
        "Backends and locations": "tests/test_storage_conformance.py",
        "Migrating from memmap-replay-buffer": "test_the_migration_blocks_run_on_the_seeds_folders",
    }
    run_here = {
        "Use",
        "Reading back",
        "Weighted mixtures",
        "Analysis with dask",
        "Statistics: exact or from sketches",
        "Named snapshots",
    }
    assert set(python_blocks()) == run_here | set(covered_elsewhere)


def test_every_error_the_readme_names_without_a_module_is_importable_from_replaybuf():
    """README (What `replaybuf` exports): each error the text names without a module is importable
    from ``replaybuf``; ``GenerationMismatchError``, ``WriterOutpacedError`` and
    ``SnapshotOverwrittenError`` were named so but lived in submodules only."""
    import builtins

    import replaybuf

    named = set(re.findall(r"`([A-Z]\w*Error)`", README.read_text())) - set(dir(builtins))
    assert named and not [name for name in sorted(named) if name not in replaybuf.__all__]
    assert all(isinstance(getattr(replaybuf, name), type) for name in named)
