from sage_tfx.components.dp_statistics_gen.component import DPSchemaGen, DPStatisticsGen

__all__ = ["DPSchemaGen", "DPStatisticsGen"]
