"""PolicyAdmin says what is wrong with the authorization header: no header, no Bearer scheme, another
scheme, Bearer without a token, or a wrong token (all UNAUTHENTICATED, over a real gRPC channel)."""

from __future__ import annotations

import grpc
import pytest

from service.proto_gen.moespec.v1 import moespec_pb2 as pb
from tests.conftest import ADMIN_TOKEN


@pytest.mark.parametrize(("header", "says"), [
    (None, "missing admin token"),
    (ADMIN_TOKEN, "lacks the Bearer scheme"),
    ("secret-token", "lacks the Bearer scheme"),
    (f"Basic {ADMIN_TOKEN}", "unsupported authorization scheme 'Basic'"),
    ("Bearer", "missing admin token after the Bearer scheme"),
    ("Bearer wrong-token", "wrong admin token"),
])
def test_the_answer_names_what_is_wrong_with_the_header(stubs, header, says):
    _, admin = stubs
    metadata = () if header is None else (("authorization", header),)
    with pytest.raises(grpc.RpcError) as e:
        admin.GetPolicy(pb.GetPolicyRequest(), metadata=metadata)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert says in e.value.details()
    assert "Bearer <token>" in e.value.details()  # and how to send it
    if header and header != ADMIN_TOKEN:
        assert ADMIN_TOKEN not in e.value.details()


def test_the_right_bearer_token_is_accepted(stubs):
    _, admin = stubs
    assert admin.GetPolicy(pb.GetPolicyRequest(), metadata=(("authorization", f"Bearer {ADMIN_TOKEN}"),)).policy_id
