"""The driver's policies: a bad name names the allowed ones; after a RETRY conserve doubles
epsilon only when the allocation can pay it on as many blocks, otherwise the window doubles."""
import pytest

from sage_tfx.pipelines.policy import Policy, PolicyName, after_retry
from sage_tfx.sage_access import BadRequest


def test_a_bad_policy_names_the_allowed_ones():
    with pytest.raises(BadRequest, match=r"unknown policy 'fast'; use one of "
                                         r"\('conserve', 'aggressive'\)"):
        Policy("fast").check()
    assert f"{PolicyName.CONSERVE}" == "conserve"


def test_after_retry_doubles_epsilon_only_when_conserve_can_pay_it():
    assert after_retry("conserve", 0.5, 4, lambda epsilon: 4) == (1.0, 4)
    assert after_retry("conserve", 0.5, 4, lambda epsilon: 3) == (0.5, 8)
    assert after_retry("aggressive", 0.5, 4, lambda epsilon: 10) == (0.5, 8)
