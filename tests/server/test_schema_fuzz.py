"""Property tests over the OpenAPI schema (schemathesis): no input may cause a 5xx."""

from __future__ import annotations

import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error

from tests.server.conftest import TOKEN


def test_no_input_causes_a_server_error(server):
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 8
    for op in operations:

        @given(case=op.as_strategy())
        @settings(
            max_examples=60,
            deadline=None,
            database=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
        )
        def check(case):
            case.call_and_validate(
                headers={"Authorization": f"Bearer {TOKEN}"}, checks=[not_a_server_error]
            )

        check()
    # The fuzzing really reached the server: count the requests it served.
    import httpx

    text = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {TOKEN}"}).text
    served = sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("reshard_http_requests_total{")
    )
    assert served >= 100
    assert 'status="500"' not in text
