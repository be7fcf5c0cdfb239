"""bench/_common.py's tree name: the checkout's commit, or ``KVFERRY_GIT`` where a device machine's copy
of the tree carries an older ``.git`` than its files."""

from __future__ import annotations

import re
import subprocess

from bench._common import REPO, git_hash


def test_tree_name_is_the_checkouts_commit(monkeypatch):
    monkeypatch.delenv("KVFERRY_GIT", raising=False)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                          check=True).stdout.strip()
    assert re.fullmatch(re.escape(head) + r"(-dirty)?", git_hash())


def test_tree_name_given_by_kvferry_git(monkeypatch):
    monkeypatch.setenv("KVFERRY_GIT", "6711855-dirty")
    assert git_hash() == "6711855-dirty"
