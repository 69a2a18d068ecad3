"""ContinualRelease component: the DP-SQLP streaming operator over newly ingested records, its
state carried from run to run as a ContinualReleaseState artifact."""
from sage_tfx.components.continual_release.component import (ContinualRelease,
                                                             ContinualReleaseState,
                                                             previous_state)

__all__ = ["ContinualRelease", "ContinualReleaseState", "previous_state"]
