"""What an RL run shows of its episodes: samples.jsonl holds, per training row, the spans of the
trajectory with their authors (model / tool / environment) and the trained-token mask, the
turns with their tool calls and results, the environment reward and the prompt after reset;
the report shows one episode per logged step with the untrained spans marked."""

import copy
import json

from posttrain import GRPOConfig, GRPOTrainer
from posttrain.envs.samples import spans, token_authors
from posttrain.report import load_runs
from posttrain.report.html import render_page

from .conftest import PROMPT
from .test_rl_on_episodes import ROWS, Arithmetic, config


class Described(Arithmetic):
    """The calculator episode whose reset ends the prompt: the rows hold PROMPT without its "?"."""

    def reset(self, row):
        super().reset(row)
        return "?"


def test_the_run_writes_episodes_with_authored_spans_and_the_trained_mask(taught, tok, tmp_path):
    cfg = config(GRPOConfig, tmp_path, **{"rollout.n": 2, "trainer.max_steps": 2, "rollout.multi_turn.max_turns": 2,
                                          "algorithm.mask_truncated_completions": True})
    trainer = GRPOTrainer(copy.deepcopy(taught), args=cfg, train_dataset=[{**r, "prompt": PROMPT[:-1]} for r in ROWS],
                          processing_class=tok, environment_factory=Described)
    trainer.train()
    lines = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1] * 4 + [2] * 4  # no eval data: the training rows of each step
    batch = trainer.last_batch
    assert batch.truncated.any() and not batch.truncated.all()  # rows in and out of the loss
    for i, row in enumerate(lines[4:]):
        assert row["split"] == "train" and row["completion"] == batch.completions[i]
        assert "".join(s["text"] for s in row["spans"]) == row["completion"]
        trained = [t for s in row["spans"] if s["trained"] for t in range(*s["tokens"])]
        assert trained == batch.response_mask[i].nonzero()[:, 0].tolist()
        assert row["spans"][-1]["tokens"][1] == int(batch.total_lengths[i])
        ep = row["episode"]
        assert ep["reset"] == "?" and ep["prompt"] == "<|bos|>" + PROMPT
        assert ep["env_reward"] == batch.columns["env_reward"][i]
        tool_spans = [s for s in row["spans"] if s["author"] == "tool"]
        calls = [c for t in ep["turns"] for c in t["calls"]]
        assert len(calls) == sum(t["tool_calls"] for t in ep["turns"]) > 0
        for call in calls:  # the calculator's real result for the arguments the model wrote, or the error shown
            if call["error"]:
                assert call["result"].startswith("error:")
            else:
                assert call["name"] == "calculator" and call["result"] == str(eval(call["arguments"]))
        assert [s["text"] for s in tool_spans] == [f"<result>{c['result']}</result>" for c in calls][: len(tool_spans)]
        assert all(not s["trained"] for s in tool_spans)
        truncated = bool(batch.truncated[i])  # the demo's third turn passes max_turns: out of the loss
        assert all(s["trained"] != truncated for s in row["spans"] if s["author"] == "model")
        assert [t["text"] for t in ep["turns"]][0].endswith("</call>")

    assert any(c["arguments"] == "23*47" and c["result"] == "1081" for x in lines for t in x["episode"]["turns"]
               for c in t["calls"])
    html = render_page(load_runs([tmp_path]), plots=[])  # the page without drawing plots
    assert html.count('class="episode"') == 2  # one episode per logged step
    for row in lines:  # every span in the table, marked by author and by whether it was trained on
        for span in row["spans"]:
            mark = "trained" if span["trained"] else "untrained"
            tip = f"{span['author']}, tokens {span['tokens']}, " + ("trained" if span["trained"] else "not trained (mask 0)")
            assert f'<span class="span {span["author"]} {mark}" title="{tip}">' in html
    assert "&lt;result&gt;1081&lt;/result&gt;" in html and "calculator(23*47)" in html


def test_spans_cut_at_author_and_mask_changes_and_join_to_the_text(tok):
    ids = tok("ab<result>7</result>cd")["input_ids"][1:]  # the byte tokenizer: one token per character
    record = {"turns": [{"bounds": [0, 2, 20], "calls": [{"name": "f"}]}, {"bounds": [20, 22, 22], "calls": []}]}
    authors = token_authors(record, len(ids))
    trained = [True, False] + [False] * 18 + [True, True]
    got = spans(tok, ids, authors, trained)
    assert [(s["author"], s["text"], s["tokens"], s["trained"]) for s in got] == [
        ("model", "a", [0, 1], True), ("model", "b", [1, 2], False), ("tool", "<result>7</result>", [2, 20], False),
        ("model", "cd", [20, 22], True),
    ]
    assert token_authors({"turns": [{"bounds": [0, 1, 3], "calls": []}]}, 3) == ["model", "environment", "environment"]
