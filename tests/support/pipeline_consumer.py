"""A downstream DP component stand-in for the pipeline test: it only checks its grant."""
from tfx.dsl.component.experimental.annotations import InputArtifact, OutputDict
from tfx.dsl.component.experimental.decorators import component
from tfx.types import standard_artifacts

from sage_tfx.components.privacy_grant import PrivacyGrant, require_grant


@component
def GrantChecker(grant: InputArtifact[PrivacyGrant],
                 examples: InputArtifact[standard_artifacts.Examples]) -> OutputDict(grant_id=str):
    info = require_grant([grant], [examples])
    return {"grant_id": info.grant_id}
