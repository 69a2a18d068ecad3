"""The ledger over ML Metadata's gRPC service, as pods reach it on Kubeflow: a server process
(sage_tfx.sage_access.grpc_server) in front of the ledger's SQLite file, the standard client."""
import json
import os
import stat
import subprocess
import sys

import pytest
from ml_metadata import errors
from ml_metadata.metadata_store import metadata_store
from ml_metadata.proto import metadata_store_pb2 as pb

from sage_tfx.sage_access import BlockIds, BlockLedger, connect, grpc_server, grpc_tls
from sage_tfx.sage_access.store import sqlite_config

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


def test_off_loopback_the_server_refuses_to_listen_without_tls(tmp_path, capsys):
    """`--host 0.0.0.0` opened the ledger to anyone on the network; now it is refused before
    anything is opened or bound."""
    path = tmp_path / "ledger.sqlite"
    for host in ("0.0.0.0", "::", "192.0.2.1"):
        assert grpc_server.main(["--store", str(path), "--host", host]) == 2
        assert f"refusing to listen on {host} without --tls" in capsys.readouterr().err
    with pytest.raises(grpc_server.InsecureListen):
        grpc_server.serve(sqlite_config(str(path)), "0.0.0.0")
    assert not path.exists()
    assert grpc_server.is_loopback("127.0.0.1") and grpc_server.is_loopback("::1")
    assert not grpc_server.is_loopback("0.0.0.0")


def _spend(path):
    """A ledger file with block b (ceiling 1) of which 0.9 is spent."""
    ledger = BlockLedger.create(path)
    ledger.add_block("b", 1.0, 1e-6)
    ledger.request(BlockIds(["b"]), epsilon=0.9, delta=0)


def _reset_spent(client):
    """The attack of issue 45: set block b's spent back to 0 through plain ML Metadata."""
    block = client.get_artifacts_by_external_ids(["block:default/b"])[0]
    block.custom_properties["spent"].string_value = "[0.0, 0.0]"
    client.put_artifacts([block])


@pytest.mark.slow
def test_off_loopback_only_a_client_with_the_ledgers_certificate_can_write(tmp_path):
    path = str(tmp_path / "ledger.sqlite")
    _spend(path)
    server_tls, client_tls = grpc_tls.make_certificates(str(tmp_path / "tls"), ["127.0.0.1"])
    _, stranger_tls = grpc_tls.make_certificates(str(tmp_path / "stranger"), ["127.0.0.1"])
    for directory in (server_tls, client_tls):
        assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
        assert {stat.S_IMODE(os.stat(os.path.join(directory, name)).st_mode)
                for name in os.listdir(directory)} == {0o600}
    with grpc_store(path, "--host", "0.0.0.0", "--tls", server_tls) as listening:
        port = int(listening.rpartition(":")[2])
        no_certificate = grpc_tls.client_config("127.0.0.1", port, client_tls, 10)
        no_certificate.ssl_config.ClearField("client_key")
        no_certificate.ssl_config.ClearField("server_cert")
        for config in (
                pb.MetadataStoreClientConfig(host="127.0.0.1", port=port, client_timeout_sec=10),
                no_certificate,  # checks the server, presents nothing
                grpc_tls.client_config("127.0.0.1", port, stranger_tls, 10)):  # another CA
            with pytest.raises(errors.UnavailableError):
                _reset_spent(metadata_store.MetadataStore(config))
        store = f"grpc://127.0.0.1:{port}?tls={client_tls}"
        denied = _ledger(store, "request", "--blocks", "b", "--epsilon", "0.9", "--delta", "0")
        assert denied.returncode == 3, denied.stderr  # the balance is as the ledger left it
        granted = _ledger(store, "request", "--blocks", "b", "--epsilon", "0.1", "--delta", "0")
        assert granted.returncode == 0, granted.stderr
    assert [grant["epsilon"] for grant in BlockLedger(path).grant_records()] == [0.9, 0.1]


@pytest.mark.slow
def test_by_default_the_server_listens_on_a_socket_only_its_user_can_open(tmp_path):
    path = str(tmp_path / "ledger.sqlite")
    _spend(path)
    with grpc_store(path, "--port", "0") as store:  # no --host: the default
        socket_path = path + ".sock"
        assert store == f"grpc+unix://{socket_path}"
        assert stat.S_ISSOCK(os.stat(socket_path).st_mode)
        assert stat.S_IMODE(os.stat(socket_path).st_mode) == 0o600
        granted = _ledger(store, "request", "--blocks", "b", "--epsilon", "0.1", "--delta", "0")
        assert granted.returncode == 0, granted.stderr
    assert not os.path.exists(socket_path)
    assert len(BlockLedger(path).grant_records()) == 2
