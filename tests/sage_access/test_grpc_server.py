"""The ledger over ML Metadata's gRPC service, as pods reach it on Kubeflow: a server process
(sage_tfx.sage_access.grpc_server) in front of the ledger's SQLite file, the standard client."""
import json
import subprocess
import sys

from ml_metadata import errors
from ml_metadata.proto import metadata_store_pb2 as pb

from sage_tfx.sage_access import BlockLedger, connect

from support.mlmd_grpc import grpc_store


def _ledger(store, *args):
    return subprocess.run([sys.executable, "-m", "sage_tfx.cli", "ledger", "--store", store,
                           *args], capture_output=True, text=True, timeout=120)


def test_the_ledger_cli_charges_through_the_server_into_the_file(tmp_path):
    path = str(tmp_path / "ledger.sqlite")
    with grpc_store(path) as store:
        assert _ledger(store, "init").returncode == 0
        for month in ("2013-01", "2013-02"):
            assert _ledger(store, "add-block", month, "--epsilon", "1", "--delta",
                           "1e-6").returncode == 0
        granted = _ledger(store, "request", "--window", "2", "--epsilon", "0.25", "--delta", "0")
        assert granted.returncode == 0, granted.stderr
        assert json.loads(granted.stdout)["blocks"] == ["2013-02", "2013-01"]
    # What the server wrote is the file's: read it directly, with the server gone.
    ledger = BlockLedger(path)
    assert [grant["blocks"] for grant in ledger.grant_records()] == [["2013-02", "2013-01"]]


def test_errors_keep_their_ml_metadata_status(tmp_path):
    with grpc_store(str(tmp_path / "ledger.sqlite")) as store:
        client = connect(store)
        type_id = client.put_artifact_type(pb.ArtifactType(name="Thing"))
        client.put_artifacts([pb.Artifact(type_id=type_id, name="one")])
        try:
            client.put_artifacts([pb.Artifact(type_id=type_id, name="one")])
        except errors.AlreadyExistsError:
            pass
        else:
            raise AssertionError("a second artifact of the same name was accepted")
        assert client.get_artifacts_by_id([12345]) == []
