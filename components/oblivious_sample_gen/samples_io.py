"""How samples are stored in an Examples artifact, and how the trainer reads them back.

Layout: `Split-train/` of the output Examples holds the slots of every epoch in training order
(epoch after epoch; within an epoch, sample after sample, then dummies).
* Without a key: `samples.tfrecord.gz` holds one serialized tf.Example per slot (an empty
  record for a dummy), and `sample_ids.npy` holds each slot's sample number (0 for a dummy).
  Use this only on trusted storage: for Poisson, the ids reveal the sample boundaries.
* With a key (AES-256-GCM, the `cryptography` package): `samples.enc.tfrecord` holds one
  ciphertext per storage unit, the `slot_width` slots one step reads (a sample for SWO and
  shuffling; a sample's padded unit for Poisson). A unit's plaintext is a sequence of
  fixed-width slots: [sample id: uint32][length: uint32][record padded to `record_width`].
  `record_width` is public, declared by the user (never the longest record, which would
  release a property of one record). A record longer than it is stored as a null record
  (length 0: the trainer gives it zero weight), i.e. dropped; a per-record map to null is
  covered by the add/remove relation. Every ciphertext of a run therefore has the same length. Each one is nonce (12 bytes) || AES-GCM(plaintext, with
  associated data = unit index), so units cannot be reordered unnoticed.
"""
from __future__ import annotations

import base64
import binascii
import os
import struct
from typing import Optional

import numpy as np
import tensorflow as tf
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from sage_tfx.components.oblivious_sample_gen.descriptor import SamplingDescriptor
from sage_tfx.private_files import private_directory, restrict_tree

PLAIN_RECORDS = "samples.tfrecord.gz"
PLAIN_IDS = "sample_ids.npy"
ENCRYPTED_RECORDS = "samples.enc.tfrecord"
_SLOT_HEADER = struct.Struct("<II")
_NONCE_BYTES = 12


def key_from_env(variable: str) -> bytes:
    """A 256-bit AES key, base64-encoded in the environment variable `variable` (on Kubeflow,
    mount it from a Secret). The key never enters ML Metadata."""
    encoded = os.environ.get(variable)
    if not encoded:
        raise ValueError(f"encryption key variable {variable!r} is not set")
    try:
        key = base64.b64decode(encoded, validate=True)
    except binascii.Error as error:
        raise ValueError(f"{variable} does not hold base64: {error}") from None
    if len(key) != 32:
        raise ValueError(f"{variable} must hold a base64-encoded 32-byte key, got {len(key)} bytes")
    return key


def write_samples(directory: str, records: np.ndarray, sample_ids: np.ndarray,
                  descriptor: SamplingDescriptor, key: Optional[bytes] = None,
                  record_width: int = 0) -> None:
    """Write the slots (serialized records, b"" for nulls and dummies); with a key, encrypted
    in units of descriptor.slot_width slots, each record padded to `record_width` bytes. The
    directory is private (0700, files 0600: private_files.py), encrypted or not."""
    private_directory(directory)
    if key is None:
        options = tf.io.TFRecordOptions(compression_type="GZIP")
        with tf.io.TFRecordWriter(os.path.join(directory, PLAIN_RECORDS), options) as writer:
            for record in records:
                writer.write(record)
        np.save(os.path.join(directory, PLAIN_IDS), sample_ids.astype(np.int32))
        restrict_tree(directory)
        return
    if record_width < 1:
        raise ValueError(f"record_width must be a positive byte count, got {record_width}")
    slots_per_unit = descriptor.slot_width
    aead = AESGCM(key)

    def slot(index: int) -> bytes:
        record = records[index]
        if len(record) > record_width:
            record = b""  # dropped: wider than the public width
        sample_id = int(sample_ids[index]) if record else 0
        return _SLOT_HEADER.pack(sample_id, len(record)) + record.ljust(record_width, b"\0")

    with tf.io.TFRecordWriter(os.path.join(directory, ENCRYPTED_RECORDS)) as writer:
        for unit, start in enumerate(range(0, len(records), slots_per_unit)):
            plaintext = b"".join(slot(index) for index in range(start, start + slots_per_unit))
            nonce = os.urandom(_NONCE_BYTES)
            writer.write(nonce + aead.encrypt(nonce, plaintext, unit.to_bytes(8, "little")))
    restrict_tree(directory)


def read_samples(directory: str, descriptor: SamplingDescriptor, record_width: int = 0,
                 key: Optional[bytes] = None) -> tuple[list[bytes], np.ndarray]:
    """(serialized records per slot, sample id per slot), decrypting when a key is given."""
    encrypted = os.path.join(directory, ENCRYPTED_RECORDS)
    if os.path.exists(encrypted):
        if key is None:
            raise ValueError(f"samples at {directory} are encrypted; a key is needed")
        aead = AESGCM(key)
        records, ids = [], []
        for unit, blob in enumerate(tf.data.TFRecordDataset(encrypted).as_numpy_iterator()):
            plaintext = aead.decrypt(blob[:_NONCE_BYTES], blob[_NONCE_BYTES:],
                                     unit.to_bytes(8, "little"))
            stride = _SLOT_HEADER.size + record_width
            for offset in range(0, len(plaintext), stride):
                sample_id, length = _SLOT_HEADER.unpack_from(plaintext, offset)
                start = offset + _SLOT_HEADER.size
                records.append(plaintext[start:start + length])
                ids.append(sample_id)
        return records, np.asarray(ids, dtype=np.int32)
    records = list(tf.data.TFRecordDataset(os.path.join(directory, PLAIN_RECORDS),
                                           compression_type="GZIP").as_numpy_iterator())
    return records, np.load(os.path.join(directory, PLAIN_IDS))
