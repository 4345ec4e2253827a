"""The plain-text protocol: `<call>NAME(ARGS)</call>` -> `<result>...</result>`."""

from posttrain.envs import ToolCall, calculator, format_call, format_results, parse_calls
from posttrain.envs.text_protocol import CALL_END, MalformedCall, TextProtocol, describe_tools
from posttrain.envs.tools import as_tool


def test_calls_are_parsed_in_order_with_raw_arguments():
    text = "First <call>calculator(23*47)</call> then <call> python(print((1+2)*3)) </call> done"
    assert parse_calls(text) == [ToolCall("calculator", "23*47"), ToolCall("python", "print((1+2)*3)")]


def test_no_call_and_an_unclosed_call_are_not_calls():
    assert parse_calls("The answer is 1081.") == []
    assert parse_calls("<call>calculator(1+1)") == []


def test_a_malformed_call_is_reported_not_dropped():
    (call,) = parse_calls("<call>2+2</call>")
    assert isinstance(call, MalformedCall) and call.message.startswith("error: malformed call '2+2'")
    assert isinstance(parse_calls("<call>calc(1+1</call>")[0], MalformedCall)


def test_format_round_trips():
    assert format_call("calculator", "23*47") == "<call>calculator(23*47)</call>"
    assert parse_calls(format_call("calculator", "23*47")) == [ToolCall("calculator", "23*47")]
    assert format_results(["1081", "error: x"]) == "<result>1081</result><result>error: x</result>"


def test_the_protocol_object_stops_on_the_call_end_and_describes_the_tools():
    protocol = TextProtocol()
    assert protocol.stop == (CALL_END,) == ("</call>",)
    assert protocol.format_results([("calculator", "1081")]) == "<result>1081</result>"
    description = describe_tools([as_tool(calculator).schema])
    assert description.startswith("Tools: calculator(expression): Evaluate an arithmetic expression")
    assert protocol.describe([]) is None
