"""The engine's releases are pinned bit for bit: a faster engine path must not change a single
released bit for the same noise key (issue 34's throughput work). The digests below were
computed by the engine before that work (main at 35f761e); every engine option that changes only
how the work is done (how many micro-batches are taken per sync, whether they are synced, how
often the state is saved) must give the same digest. The factorization's digests were computed
again when its noise law changed on purpose (the column-normalised encoder, factorization.py;
keys34 at 91833fc, before its merge with the throughput work, which gives the same bits)."""
import hashlib
import json

import numpy as np
import pandas as pd
import pytest

from sage_tfx.dp_statistics.continual import local
from sage_tfx.dp_statistics.continual.budget import plan
from sage_tfx.dp_statistics.continual.spec import StreamQuery

NOISE_KEY = bytes(range(32))
MICRO_BATCHES = 70  # three of the indexes' 32-step blocks, the last one partial

# (mechanism, statistic, key kind) -> sha256 of every release (step, keys, values, updated)
RELEASE_DIGESTS = {
    ("tree", "count", "integers"): "f53bfbfca497b4dfd2a901d16b240882735e03153f886650295b0de910145eb6",
    ("tree", "count", "strings"): "3bfa5f4c25f33c235a29bbee1caa9ce98f9258eea0d7635af3e149ffdad2a543",
    ("tree", "sum", "integers"): "91d764411f8fe9560ae8f0a6d9027f0b6bb458a7eb75e6cc472e1933cc487898",
    ("tree", "sum", "strings"): "c3c6e96e635a64a5556437262460e813eb00ae878261a80e41f130550a9e87dd",
    ("factorization", "count", "integers"):
        "2cbdf807d8b46a839874bb721a63ee326b7ed085b7074fde626b043bd29c9a6b",
    ("factorization", "count", "strings"):
        "c97570c14c83782041f15cae5b3e391bef8084c82c4a0b097a727cc4c603d167",
    ("factorization", "sum", "integers"):
        "ddc12029df959f8b546aee6e0eea12a7c41c92c9200e7eadc1105f839ce71f8e",
    ("factorization", "sum", "strings"):
        "05a082ceeaf1b0bb5a8cb3f0db11f8b30dc3b56afc34b53c2c176ff6b6e83f7a",
}


def stream(strings: bool):
    """70 micro-batches (step 9 and steps 40-45 empty) of 0-120 records: 600 units, Zipf keys
    (a few hundred, most of them rare), values with NaN and out-of-bound ones."""
    rng = np.random.default_rng(34)
    for step in range(1, MICRO_BATCHES + 1):
        if step == 9 or 40 <= step <= 45:
            continue
        size = int(rng.integers(0, 120))
        units = rng.integers(0, 600, size)
        keys = np.minimum(rng.zipf(1.3, size), 400)
        values = np.round(rng.normal(3.0, 4.0, size), 3)
        values[rng.random(size) < 0.05] = np.nan
        if strings:
            units = np.array([f"u{u}" for u in units], dtype=object)
            keys = np.array([f"key-{k:03d}" for k in keys], dtype=object)
        yield step, pd.DataFrame({"unit": units, "key": keys, "value": values})


def query(mechanism: str, statistic: str) -> StreamQuery:
    summed = statistic == "sum"
    return StreamQuery(key_column="k", unit_column="u", time_column="t",
                       value_column="v" if summed else None,
                       value_bound=5.0 if summed else 1.0, contribution_limit=4,
                       micro_batches=MICRO_BATCHES, epsilon=4.0, delta=1e-6,
                       mechanism=mechanism)


def release_digest(tmp_path, mechanism, statistic, strings, stop_at=None, **options) -> str:
    """The digest of the window's releases; with `stop_at`, the run stops after that step and
    a second run resumes from the state it saved there."""
    window = query(mechanism, statistic)
    budget = plan(window.epsilon, window.delta, MICRO_BATCHES, window.contribution_limit,
                  window.value_bound, mechanism=mechanism)
    digest = hashlib.sha256()

    def sink(release):
        digest.update(json.dumps([int(release.step), release.keys.tolist(),
                                  release.guarantee]).encode())
        digest.update(np.asarray(release.values, np.float64).tobytes())
        digest.update(np.asarray(release.updated, bool).tobytes())
    if stop_at is not None:
        local.run_local(window, budget, ((step, batch) for step, batch in stream(strings)
                                         if step <= stop_at),
                        str(tmp_path), sink, noise_key=NOISE_KEY, complete_window=False,
                        snapshot_every=stop_at, **options)
    local.run_local(window, budget, stream(strings), str(tmp_path), sink, noise_key=NOISE_KEY,
                    **options)
    return digest.hexdigest()


CASES = [(mechanism, statistic, strings) for mechanism in ("tree", "factorization")
         for statistic in ("count", "sum") for strings in (False, True)]


@pytest.mark.parametrize("mechanism, statistic, strings", CASES)
def test_the_releases_are_the_pinned_bits(tmp_path, mechanism, statistic, strings):
    assert release_digest(tmp_path, mechanism, statistic, strings) == RELEASE_DIGESTS[
        mechanism, statistic, "strings" if strings else "integers"]


@pytest.mark.parametrize("mechanism", ["tree", "factorization"])
@pytest.mark.parametrize("options", [{"take_ahead": 8}, {"take_ahead": 70, "fsync": False},
                                     {"take_ahead": 3, "snapshot_every": 1}],
                         ids=["take-8", "take-all-no-sync", "take-3-save-every-step"])
def test_how_the_engine_takes_and_saves_changes_no_released_bit(tmp_path, mechanism, options):
    assert release_digest(tmp_path, mechanism, "sum", True, **options) == RELEASE_DIGESTS[
        mechanism, "sum", "strings"]


@pytest.mark.parametrize("mechanism", ["tree", "factorization"])
def test_a_window_resumed_from_its_saved_state_releases_the_pinned_bits(tmp_path, mechanism):
    """The second run loads the state saved at step 38 (the selection streams' summaries
    recomputed, in their second block) and goes on from there."""
    assert release_digest(tmp_path, mechanism, "count", False, stop_at=38) == RELEASE_DIGESTS[
        mechanism, "count", "integers"]
