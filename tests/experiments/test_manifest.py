"""experiments/manifest.py: what a results folder records about how it was made."""

from __future__ import annotations

import hashlib
import json

from experiments.manifest import ROOT, git, profiles_simulated_with, write_manifest


def test_a_manifest_records_commit_command_host_profiles_and_date(tmp_path):
    profile = tmp_path / "p.csv"
    profile.write_text("# device: x\nlatency_s\n0.01\n")
    path = write_manifest(tmp_path / "out", "python -m experiments.x --y", [profile], note="n")
    manifest = json.loads(path.read_text())
    assert path == tmp_path / "out" / "manifest.json"
    assert manifest["git_sha"] == git("rev-parse", "HEAD") and len(manifest["git_sha"]) == 40
    assert isinstance(manifest["git_dirty"], bool)
    assert manifest["command"] == "python -m experiments.x --y"
    assert manifest["host"]["name"] and manifest["host"]["cpu"]
    assert manifest["profile_sha1"] == {
        str(profile): hashlib.sha1(profile.read_bytes()).hexdigest()
    }
    assert manifest["date"].endswith("Z") and manifest["note"] == "n"
    # Without a command: this process's own command line.
    assert json.loads(write_manifest(tmp_path / "again").read_text())["command"]


def test_a_profile_in_the_checkout_is_recorded_by_its_path_in_it(tmp_path):
    profile = ROOT / "profiles" / "cpu1" / "dummy-llama.csv"
    path = write_manifest(tmp_path, "x", [profile.resolve()])
    assert list(json.loads(path.read_text())["profile_sha1"]) == ["profiles/cpu1/dummy-llama.csv"]


def test_the_profiles_a_fidelity_result_was_simulated_with_are_read_from_its_meta(tmp_path):
    source = (
        "profile dummy-llama.csv (cpu, 2026-12-04; sha1 0123456789; level 1.0054, the replay's)"
    )
    meta = {"meta": {"simulated_with": [source, "roofline"]}}
    (tmp_path / "fidelity.json").write_text(json.dumps(meta))
    assert profiles_simulated_with(tmp_path) == {"dummy-llama.csv": "0123456789"}
    assert profiles_simulated_with(tmp_path / "none") == {}


def test_every_committed_result_has_a_manifest_and_a_readme_and_a_line_in_the_index():
    results = ROOT / "experiments" / "results"
    folders = sorted(p for p in results.iterdir() if p.is_dir())
    index = (results / "INDEX.md").read_text()
    for folder in folders:
        assert (folder / "README.md").is_file(), folder
        assert json.loads((folder / "manifest.json").read_text())["git_sha"], folder
        assert f"`{folder.name}/`" in index, folder
