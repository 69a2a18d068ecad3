"""Checks on public stand-ins, made once per process for each module file and public parameters.

DP-SGD's stand-in check (dp_trainer/stand_in.check_module) and DPTransform's stand-in pass
(dp_transform.executor.stand_in_pass) run the user's module on public stand-in records
(util/stand_ins.py) and cost seconds each (a traced DP-SGD step; a whole Beam run). A pipeline
makes them in the BlockLedger's preflight and DP-SGD's again in DPTrainer, in one process under
LocalDagRunner; a privacy-adaptive driver and a test file make them for every iteration. So a
check that passed is not made again in this process for the same key: the module file's name,
the SHA-256 of its bytes and the public parameters the check reads.

Why this cannot change what is refused:
- Only passes are remembered: a check that refuses is made again, and refuses again, every time.
- The check reads no record: its outcome is a function of the module's code and the public
  parameters, both in the key. A module file that changed has a new digest and is checked
  afresh (the file is executed afresh on each load, user_module.import_module_file; what it
  imports stays as first imported for the life of the process, in sys.modules).
- So a remembered pass is the outcome the check would have again, and, depending on no record,
  it tells nothing about the data either way.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
from typing import Callable, Hashable

_passed: set[tuple] = set()


def module_digest(module_file: str) -> str:
    """SHA-256 of the bytes of the module a `module_file` names: the file, or the source file of
    an importable module path (user_module.import_module_file loaded it already)."""
    path = module_file if os.path.isfile(module_file) else \
        importlib.util.find_spec(module_file).origin
    with open(path, "rb") as source:
        return hashlib.sha256(source.read()).hexdigest()


def check_once(check: str, module_file: str, parameters: Hashable,
               run: Callable[[], None]) -> None:
    """`run()` (the check named `check` of the module at `module_file`, reading `parameters`)
    unless it passed already in this process for the same module bytes and parameters; its
    refusal propagates and is not remembered."""
    key = (check, module_file, module_digest(module_file), parameters)
    if key in _passed:
        return
    run()
    _passed.add(key)
