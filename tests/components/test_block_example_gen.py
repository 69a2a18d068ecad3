"""BlockExampleGen's reading of CSV rows: the bytes it stores (and hashes for the train/test
split) depend on the row only, not on the process that read it."""
import subprocess
import sys

import pytest

READ = ("import sys; from sage_tfx.components.block_example_gen.executor import csv_records; "
        "sys.stdout.write(''.join(r.hex() + '\\n' for r in csv_records(sys.argv[1])))")


@pytest.mark.slow  # four processes importing TensorFlow
def test_a_row_is_serialized_to_the_same_bytes_in_every_process(tmp_path):
    path = tmp_path / "trips.csv"
    columns = [f"c{index}" for index in range(12)]   # enough map entries for order to vary
    rows = [",".join(str(row * 13 + index) for index in range(12)) for row in range(20)]
    path.write_text(",".join(columns) + "\n" + "\n".join(rows) + "\n")
    outputs = {subprocess.run([sys.executable, "-c", READ, str(path)], check=True,
                              capture_output=True, text=True,
                              env={"PYTHONHASHSEED": str(seed), "PATH": "/usr/bin:/bin"}).stdout
               for seed in range(4)}
    assert len(outputs) == 1
    assert len(next(iter(outputs)).splitlines()) == 20
