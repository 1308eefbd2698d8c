"""A recorded launch command's options (serving_io.launch_args): the one parser the bench's
admission rule, the P/D file reader and the validation harness share."""

from sglang_diffkv.serving_io.launch_args import launch_args


def test_every_option_form_by_its_server_args_name():
    argv = ["python3", "-m", "sglang.launch_server", "--model-path", "/tmp/m",
            "--tp-size=2", "--disable-radix-cache", "--chunked-prefill-size", "-1",
            "--base-gpu-id", "0"]
    assert launch_args(argv) == {"model_path": "/tmp/m", "tp_size": "2",
                                 "disable_radix_cache": "True",
                                 "chunked_prefill_size": "-1", "base_gpu_id": "0"}


def test_a_shell_line_reads_as_its_argv_and_the_last_value_wins():
    line = "env A='x y' python3 -m sglang.launch_server --port 30000 --port 30001 --enable-metrics"
    assert launch_args(line) == {"port": "30001", "enable_metrics": "True"}
    assert launch_args(line.split()) == launch_args(line)


def test_an_unbalanced_quote_falls_back_to_plain_words():
    assert launch_args("python3 -m x --base-gpu-id 1 --note 'oops") == {
        "base_gpu_id": "1", "note": "'oops"}
    assert launch_args("") == {}
