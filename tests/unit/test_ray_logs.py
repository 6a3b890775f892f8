"""The console stays readable: after `ray_logs_to_file`, Ray's own loggers write to the
run's log file and not to the terminal, Ray Data's progress reports are off, the file
is named once, and setting it again for the same file adds no second handler."""

import logging

from pipelines.common.ray_cluster import ray_logs_to_file


def test_ray_lines_go_to_the_file_not_the_console(tmp_path, capfd):
    import ray.data
    path = ray_logs_to_file(tmp_path / "logs" / "ray.log")
    assert ray_logs_to_file(tmp_path / "logs" / "ray.log") == path  # idempotent
    out = capfd.readouterr()
    assert out.out.count(str(path)) == 1
    logging.getLogger("ray.data").warning("progress line that would flood the console")
    logging.getLogger("ray.train").warning("train line")
    for h in logging.getLogger("ray.data").handlers:
        h.flush()
    out = capfd.readouterr()
    assert "flood" not in out.err + out.out and "train line" not in out.err + out.out
    text = path.read_text()
    assert "progress line that would flood the console" in text and "train line" in text
    assert text.count("train line") == 1  # one handler, not two
    assert ray.data.DataContext.get_current().enable_progress_bars is False
