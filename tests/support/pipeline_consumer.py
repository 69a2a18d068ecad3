"""A downstream DP component stand-in for the pipeline test: it only checks its grant."""
from tfx.dsl.component.experimental.annotations import InputArtifact, OutputDict
from tfx.dsl.component.experimental.decorators import component

from sage_tfx.components import PrivateExamples, declare_dp
from sage_tfx.components.privacy_grant import PrivacyGrant, require_grant


@component
def GrantChecker(grant: InputArtifact[PrivacyGrant],
                 examples: InputArtifact[PrivateExamples]) -> OutputDict(grant_id=str):
    info = require_grant([grant], [examples])
    return {"grant_id": info.grant_id}


declare_dp(GrantChecker, guarantee="publishes only the id of its grant, never a record")
