"""Schemas without TFDV: the public features and clamping bounds a user's schema.pbtxt gives
DPStatisticsGen, and a schema inferred from DP statistics (DPSchemaGen, a small SchemaGen
stand-in). tensorflow-metadata's protos only; every input here is public (the user's file, or
statistics that are already DP: inferring from them is post-processing)."""
from __future__ import annotations

from typing import Mapping, Optional, Sequence

from google.protobuf import text_format
from tensorflow_metadata.proto.v0 import schema_pb2, statistics_pb2

from sage_tfx.components.dp_statistics_gen.statistics import StatisticsError

SCHEMA_FILE = "schema.pbtxt"  # TFX's SchemaGen and ImportSchemaGen write this name
STATISTICS_FILE = "FeatureStats.pb"  # TFX's StatisticsGen: one per Split-<name> directory
# TFDV's infer_schema default: a string feature with at most this many values gets a domain.
MAX_STRING_DOMAIN_SIZE = 100

_KIND_OF_TYPE = {schema_pb2.INT: "int", schema_pb2.FLOAT: "float", schema_pb2.BYTES: "string"}


def read_schema(path: str) -> schema_pb2.Schema:
    """The Schema in text format at `path`; StatisticsError naming the file otherwise."""
    import tensorflow as tf

    try:
        with tf.io.gfile.GFile(path, "r") as handle:
            return text_format.Parse(handle.read(), schema_pb2.Schema())
    except (OSError, tf.errors.OpError, text_format.ParseError) as error:
        raise StatisticsError(f"schema file {path!r} does not read as a "
                              f"tensorflow_metadata Schema: {error}") from None


def columns_and_bounds(schema: schema_pb2.Schema) -> tuple[dict[str, str],
                                                           dict[str, tuple[float, float]]]:
    """({feature: "int" | "float" | "string"}, {feature: (min, max)}) from a schema: the bounds
    of a feature's own int_domain / float_domain, or of the schema-level domain it names,
    where both min and max are set."""
    domains = {d.name: d for d in list(schema.int_domain) + list(schema.float_domain)}
    columns, bounds = {}, {}
    for feature in schema.feature:
        if feature.type not in _KIND_OF_TYPE:
            raise StatisticsError(f"schema feature {feature.name!r} has type "
                                  f"{schema_pb2.FeatureType.Name(feature.type)}; DP statistics "
                                  "read INT, FLOAT and BYTES features")
        columns[feature.name] = _KIND_OF_TYPE[feature.type]
        which = feature.WhichOneof("domain_info")
        domain = (getattr(feature, which) if which in ("int_domain", "float_domain")
                  else domains.get(feature.domain) if which == "domain" else None)
        if domain is not None and domain.HasField("min") and domain.HasField("max"):
            bounds[feature.name] = (float(domain.min), float(domain.max))
    return columns, bounds


def public_features(schema_file: Optional[str], columns: Optional[Mapping[str, str]],
                    bounds: Optional[Mapping[str, Sequence[float]]]):
    """DPStatisticsGen's features: the schema file's (or `columns`), with the schema's bounds
    overridden by `bounds`. StatisticsError when a numeric feature has none (before the
    charge: statistics.features_from)."""
    from sage_tfx.components.dp_statistics_gen.statistics import features_from

    if (schema_file is None) == (columns is None):
        raise StatisticsError("give the features either as a schema file or as columns, not "
                              "both or neither")
    schema_bounds = {}
    if schema_file is not None:
        columns, schema_bounds = columns_and_bounds(read_schema(schema_file))
    merged = {**schema_bounds, **{name: tuple(pair) for name, pair in (bounds or {}).items()}}
    return features_from(dict(columns), merged)


def infer_schema(statistics: statistics_pb2.DatasetFeatureStatisticsList) -> schema_pb2.Schema:
    """A schema from DP statistics, as TFDV's infer_schema makes one (feature types; one value
    per example; presence; a string domain of the released values when there are at most
    MAX_STRING_DOMAIN_SIZE). Presence: required (min_fraction 1) when the DP missing count
    rounds to 0, which the count's noise makes a statement about the noisy count only."""
    types = {statistics_pb2.FeatureNameStatistics.INT: schema_pb2.INT,
             statistics_pb2.FeatureNameStatistics.FLOAT: schema_pb2.FLOAT,
             statistics_pb2.FeatureNameStatistics.STRING: schema_pb2.BYTES,
             statistics_pb2.FeatureNameStatistics.BYTES: schema_pb2.BYTES}
    schema = schema_pb2.Schema()
    [dataset] = statistics.datasets
    for stats in dataset.features:
        name = ".".join(stats.path.step) or stats.name
        feature = schema.feature.add(name=name, type=types[stats.type])
        common = (stats.num_stats if stats.HasField("num_stats") else
                  stats.string_stats).common_stats
        feature.value_count.min = feature.value_count.max = 1
        feature.presence.min_count = 1
        if common.num_missing == 0:
            feature.presence.min_fraction = 1.0
        if stats.HasField("string_stats") and 0 < stats.string_stats.unique <= \
                MAX_STRING_DOMAIN_SIZE:
            domain = schema.string_domain.add(name=name)
            domain.value.extend(sorted(b.label for b in stats.string_stats.rank_histogram.buckets))
            feature.domain = name
    return schema
