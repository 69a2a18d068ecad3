"""TFX's own taxi template made private (examples/tfx_taxi, docs/tfx-pipeline.md): the
acceptance figures of issue 44 part 6.

* local: the converted DAG on LocalDagRunner (pipelines.local.run_local): its stages, the wall
  time, whether Pusher pushed, each grant's epsilon per block and release status.
* auc: on the held-out `eval` split of every block, the AUC of the pushed DP model (its
  `serving_default` signature on the raw records) and of the same model (the module's
  `_build_keras_model`, compiled as the module compiles it: Adam, binary cross-entropy) fitted
  without DP by plain Keras on the same transformed training records, the same epochs and
  batch size 40 (run_fn's); the ratio must be at least 0.9.
* kubeflow (--kubeflow): the same DAG compiled for Kubeflow V2 and run by
  `sage-tfx kubeflow run-local`, a process per task, the ledger behind ML Metadata's gRPC
  service (as benchmarks/kubeflow_local.py).

    python benchmarks/tfx_taxi.py [--workdir out/bench-tfx-taxi] [--epochs 4] [--seed S]
                                  [--kubeflow]

Prints one JSON object. `--seed` fixes the noise and sampling (a ledger for tests); without it
the run is as a user's, and the held-out AUCs (which read the records without DP) are not
measured.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import sys
import time
from typing import Optional

import sage_tfx  # noqa: F401  (TF_USE_LEGACY_KERAS before TensorFlow loads)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kubeflow_run import ledger_server, run_local  # noqa: E402

BATCH_SIZE = 40  # run_fn's


def run_pipeline(workdir: str, epochs: int, seed: Optional[int]) -> dict:
    """The converted DAG on LocalDagRunner in `workdir` (a new ledger in the pipeline's own
    ML Metadata file): wall time, stages, grants, the pushed model's directory."""
    from tfx.orchestration import metadata

    from sage_tfx.examples.tfx_taxi import pipeline, template
    from sage_tfx.pipelines.local import run_local
    from sage_tfx.sage_access import BlockLedger

    store = os.path.join(workdir, "metadata.sqlite")
    BlockLedger.create(store, for_tests=seed is not None)
    built = pipeline.create_pipeline(
        pipeline.PIPELINE_NAME, os.path.join(workdir, "pipelines"), template.data_root(),
        pipeline.MODULE, os.path.join(workdir, "serving_model"), store,
        template.schema_file(), seed=seed, epochs=epochs,
        metadata_connection_config=metadata.sqlite_metadata_connection_config(store))
    started = time.monotonic()
    run_local(built)
    seconds = time.monotonic() - started
    return {"seconds": round(seconds, 1), "stages": [c.id for c in built.components],
            **ledger_outcome(store), "pushed": pushed_model(os.path.join(workdir,
                                                                         "serving_model"))}


def ledger_outcome(store: str) -> dict:
    """Each grant: its epsilon per block (a grant charges every block it names its epsilon),
    its blocks, its release record (outcome) and each step's."""
    from sage_tfx.sage_access import BlockLedger

    ledger = BlockLedger(store)
    grants = [{"epsilon": grant["epsilon"], "delta": grant["delta"],
               "blocks": len(grant["blocks"]), "outcome": grant["outcome"],
               "steps": {step: record["outcome"] for step, record in grant["steps"].items()}}
              for grant in ledger.grant_records()]
    spent = [float(block.spent[0]) for block in ledger.blocks()]
    return {"grants": grants, "max_epsilon_per_block": max(spent) if spent else 0.0}


def pushed_model(serving_model_dir: str) -> Optional[str]:
    """The newest version Pusher wrote under `serving_model_dir`, or None."""
    versions = sorted(glob.glob(os.path.join(serving_model_dir, "*", "saved_model.pb")))
    return os.path.dirname(versions[-1]) if versions else None


def artifact_uri(store: str, type_name: str, producer: str) -> str:
    """The uri of the one artifact of `type_name` under the producer component's directory."""
    from sage_tfx.sage_access import connect

    [uri] = [a.uri for a in connect(store).get_artifacts_by_type(type_name)
             if f"{os.sep}{producer}{os.sep}" in a.uri]
    return uri


def held_out_aucs(store: str, model_dir: str, epochs: int, seed: int) -> dict:
    """The DP model's AUC and the plain Keras model's on the held-out split (module
    docstring), both on the same transformed records. They read the records without DP, so
    only a ledger for tests may be measured this way (BadRequest otherwise)."""
    from sage_tfx.sage_access import BlockLedger
    from sage_tfx.sage_access.errors import BadRequest

    if not BlockLedger(store).for_tests:
        raise BadRequest("the held-out AUCs read the ledger's records without DP: measure them "
                         "on a ledger for tests (--seed), never on a user's ledger")
    import numpy as np
    import tensorflow as tf
    import tensorflow_transform as tft
    from sklearn.metrics import roc_auc_score

    from sage_tfx.components.dag_guard import PrivateExamples
    from sage_tfx.components.util.examples_io import EVAL_SPLIT, TRAIN_SPLIT, read_split
    from sage_tfx.components.util.user_module import RecordDecoder, UserModule, declared_inputs
    from sage_tfx.examples.tfx_taxi import pipeline

    examples = artifact_uri(store, PrivateExamples.TYPE_NAME, "BlockLedger")
    transform_output = tft.TFTransformOutput(artifact_uri(store, "TransformGraph", "DPTransform"))
    train, held_out = (read_split(examples, split).numpy().tolist()
                       for split in (TRAIN_SPLIT, EVAL_SPLIT))
    module = UserModule.load(pipeline.MODULE, "benchmark", model_fn=pipeline.MODEL_FN)

    tf.keras.utils.set_random_seed(seed)
    model = module.build_model()  # compiled by the module: Adam(0.001), binary cross-entropy
    decoder = RecordDecoder(module, transform_output, inputs=declared_inputs(model))
    train_inputs, train_labels = decoder.decode(train)
    held_inputs, held_labels = decoder.decode(held_out)
    model.fit(train_inputs, train_labels, batch_size=BATCH_SIZE, epochs=epochs, verbose=0)
    plain = np.ravel(model.predict(held_inputs, batch_size=1024, verbose=0))

    serving = tf.saved_model.load(model_dir).signatures["serving_default"]
    outputs = serving(examples=tf.constant(held_out))
    private = np.ravel(next(iter(outputs.values())).numpy())
    labels = np.ravel(held_labels.numpy())
    dp_auc, plain_auc = roc_auc_score(labels, private), roc_auc_score(labels, plain)
    return {"held_out_records": len(held_out), "dp_auc": round(float(dp_auc), 4), "plain_auc": round(float(plain_auc), 4),
            "ratio": round(float(dp_auc / plain_auc), 4), "epochs": epochs}


def kubeflow_run(workdir: str, epochs: int, seed: Optional[int]) -> dict:
    """Compile the DAG for Kubeflow V2 with the ledger behind a gRPC server, run it with
    `sage-tfx kubeflow run-local`: wall times, tasks, grants, the pushed model."""
    from sage_tfx.examples.tfx_taxi import pipeline, template
    from sage_tfx.pipelines.kubeflow import compile_kubeflow
    from sage_tfx.sage_access import BlockLedger

    with ledger_server(workdir) as store:
        BlockLedger.create(store, for_tests=seed is not None)
        job, root = os.path.join(workdir, "job.json"), os.path.join(workdir, "root")
        serving = os.path.join(workdir, "serving_model")
        started = time.monotonic()
        compile_kubeflow(pipeline.create_pipeline, job, "local",
                         pipeline_name=pipeline.PIPELINE_NAME, pipeline_root=root,
                         data_root=template.data_root(), module_file=pipeline.MODULE,
                         serving_model_dir=serving, ledger_store=store,
                         schema_file=template.schema_file(), seed=seed, epochs=epochs)
        compiled = time.monotonic()
        return {"compile_seconds": round(compiled - started, 1), **run_local(job, root),
                **ledger_outcome(store), "pushed": pushed_model(serving)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="out/bench-tfx-taxi")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--kubeflow", action="store_true")
    args = parser.parse_args()
    shutil.rmtree(args.workdir, ignore_errors=True)
    local = os.path.abspath(os.path.join(args.workdir, "local"))
    os.makedirs(local)
    results = {"local": run_pipeline(local, args.epochs, args.seed)}
    if results["local"]["pushed"] and args.seed is not None:
        results["auc"] = held_out_aucs(os.path.join(local, "metadata.sqlite"),
                                       results["local"]["pushed"], args.epochs,
                                       0 if args.seed is None else args.seed)
    if args.kubeflow:
        workdir = os.path.abspath(os.path.join(args.workdir, "kubeflow"))
        os.makedirs(workdir)
        results["kubeflow_run_local"] = kubeflow_run(workdir, args.epochs, args.seed)
    results["load_average"] = [round(x, 1) for x in os.getloadavg()]
    results["cpus"] = os.cpu_count()
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
