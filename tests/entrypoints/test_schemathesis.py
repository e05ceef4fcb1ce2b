"""Property-based API testing with schemathesis against the live server's own /openapi.json: whatever
the generated request, valid or not, no 5xx, every status is documented and every response matches
its documented schema.
Hypothesis drives each operation's strategy directly: schemathesis's lazy pytest fixture loader
(`from_fixture`) sets `Node._nodeid`, which pytest 9 no longer has."""
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import response_schema_conformance, status_code_conformance

from server_utils import HEADERS, serve, wait_all_blocks_free

MAX_TOKENS = 4
MAX_MODEL_LEN = 64
EXAMPLES_PER_MODE = 30
CHECKS = [not_a_server_error, response_schema_conformance, status_code_conformance]  # the last: statuses documented
WITH_BODY = {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"}
OPERATIONS = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
              ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/metrics"), ("GET", "/health"),
              ("GET", "/ping"), ("POST", "/ping"), ("GET", "/version"), ("GET", "/dashboard"),
              ("GET", "/dashboard/stats")]


@pytest.fixture(scope="module")
def fuzzed_server(text_model):
    """A small max_model_len bounds every prompt and output the fuzzer can ask for."""
    with serve(text_model[0], num_kv_blocks=64, max_num_seqs=4, max_model_len=MAX_MODEL_LEN) as running:
        yield running


@pytest.fixture(scope="module")
def api_schema(fuzzed_server):
    return schemathesis.openapi.from_url(f"{fuzzed_server.url}/openapi.json", headers=HEADERS, timeout=10)


def test_openapi_is_valid_and_lists_the_operations_fuzzed_here(api_schema):
    api_schema.validate()  # against the OpenAPI meta-schema
    documented = {(op.ok().method.upper(), op.ok().path) for op in api_schema.get_all_operations()}
    assert documented == set(OPERATIONS)


@pytest.mark.parametrize("method, path, mode", [(method, path, mode) for method, path in OPERATIONS
                                                 for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
                                                 if path in WITH_BODY or mode == GenerationMode.POSITIVE])
def test_operation_conforms_to_its_schema(api_schema, fuzzed_server, method, path, mode):
    """Negative cases need something to break: a body (the other operations take no parameters)."""
    @given(case=api_schema[path][method].as_strategy(mode))
    @settings(max_examples=EXAMPLES_PER_MODE, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    def check(case):
        _cap_generation(case)
        case.call_and_validate(headers=HEADERS, timeout=30, checks=CHECKS)
    check()


def _cap_generation(case):
    """Generated tokens cost model steps: keep the fuzzer's max_tokens small."""
    if isinstance(case.body, dict):
        for field in ("max_tokens", "max_completion_tokens"):
            if isinstance(case.body.get(field), int) and case.body[field] > MAX_TOKENS:
                case.body[field] = MAX_TOKENS


def test_fuzzing_left_no_blocks_behind(fuzzed_server):
    wait_all_blocks_free(fuzzed_server, timeout=30)
