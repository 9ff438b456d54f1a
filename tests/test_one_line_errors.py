"""Errors that named no file or quoted Python's internals, each now one line naming the file
and the way out: a binary YAML config, a 5,000-digit number (YAML and JSON), ``evaluate_fid.py
--batch-size 0``, a damaged .npy header in an .npz, a full disk under training's log.jsonl and
TensorBoard writes and ``sample.py --out``'s files, images of different sizes in a folder."""
import errno
import json
import zipfile
from types import SimpleNamespace

import numpy as np
import pytest

from tests.utils import one_line


def test_a_binary_or_huge_number_config_is_one_line(tmp_path, capsys):
    import train

    (tmp_path / "bin.yaml").write_bytes(b"\xff\xfe\x00binary")
    (tmp_path / "big.yaml").write_text("max-steps: " + "1" * 5000 + "\n")
    for name, expect in (("bin.yaml", "not a text file (byte 0xff at offset 0 is not UTF-8)"),
                         ("big.yaml", "holds a number of 5,000 digits (Python reads at most 4,300)")):
        with pytest.raises(SystemExit):
            train.main(["--config", str(tmp_path / name)])
        err = capsys.readouterr().err
        line = next(line for line in err.splitlines() if "error:" in line)
        assert f"{tmp_path / name}: {expect}" in line and "codec" not in err and "set_int_max" not in err, err


def test_read_json_names_a_binary_file_and_a_huge_number(tmp_path):
    from nala_dit.guards import read_json

    (tmp_path / "bin.json").write_bytes(b"\x89PNG")
    (tmp_path / "big.json").write_text('{"a": ' + "1" * 5000 + "}")
    for name, expect in (("bin.json", "not a text file (byte 0x89"), ("big.json", "holds a number of 5,000 digits")):
        with pytest.raises(ValueError) as err:
            read_json(tmp_path / name, "write it again")
        assert one_line(err).startswith(f"{tmp_path / name}: {expect}") and "set_int_max" not in one_line(err)


@pytest.mark.parametrize("flag", ["--batch-size", "--split-size"])
def test_evaluate_fid_refuses_a_zero_batch(tmp_path, capsys, flag):
    import evaluate_fid

    assert evaluate_fid.main(["calc", "--samples", str(tmp_path / "s.npz"), "--ref", str(tmp_path / "r.npz"),
                              flag, "0"]) == 1
    assert capsys.readouterr().err.strip() == f"error: {flag} must be >= 1, got 0"


def test_a_damaged_npy_header_names_the_file(tmp_path):
    from nala_dit.evaluation.features import iter_npz_array, npz_array_shape

    np.savez(tmp_path / "good.npz", arr_0=np.zeros((4, 8, 8, 3), np.uint8))
    with zipfile.ZipFile(tmp_path / "good.npz") as z:
        data = z.read("arr_0.npy")
    with zipfile.ZipFile(tmp_path / "bad.npz", "w") as z:
        z.writestr("arr_0.npy", data[:10] + b"{garbage header!" + data[26:])
    for read in (lambda p: npz_array_shape(p), lambda p: next(iter_npz_array(p))):
        with pytest.raises(ValueError) as err:
            read(tmp_path / "bad.npz")
        assert one_line(err) == (f"{tmp_path / 'bad.npz'}:arr_0: damaged .npy header (its shape and dtype cannot be "
                                 f"read); write the file again")


def test_images_of_another_size_name_the_file(tmp_path):
    from PIL import Image

    from nala_dit.evaluation.features import iter_image_folder

    for i in range(3):
        Image.new("RGB", (8, 8)).save(tmp_path / f"{i}.png")
    Image.new("RGB", (9, 8)).save(tmp_path / "3.png")
    with pytest.raises(ValueError) as err:
        list(iter_image_folder(tmp_path, batch_size=4))
    assert one_line(err).startswith(f"{tmp_path / '3.png'} is 9x8 px, {tmp_path / '0.png'} 8x8: all images in a "
                                    f"folder must have the same size")


def test_a_full_disk_under_the_training_log_is_one_line(tmp_path):
    """log.jsonl on /dev/full (a real ENOSPC), then the trackers' write failing the same way."""
    from nala_dit.training.tracking import Logger

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    logger = Logger(tmp_path, SimpleNamespace(is_main_process=True, log=full), report_to="none")
    logger.file.close()
    logger.file = open("/dev/full", "w")
    with pytest.raises(OSError) as err:
        logger.log(7, {"loss": 1.0})
    assert one_line(err) == (f"cannot write {tmp_path / 'log.jsonl'} at step 7: No space left on device (disk full?); "
                             f"the checkpoints already written are intact: free space and rerun with --resume auto")
    logger.file = open(tmp_path / "log.jsonl", "a")
    with pytest.raises(OSError) as err:
        logger.log(8, {"loss": 1.0})
    assert one_line(err).startswith(f"cannot write {tmp_path / 'tensorboard'} at step 8: No space left on device")
    assert "Errno" not in str(err.value)
    assert json.loads((tmp_path / "log.jsonl").read_text())["step"] == 8


def test_a_full_disk_under_sample_out_is_one_line_without_errno(tmp_path):
    from nala_dit.pipelines.sample_files import _disk_full_line

    with pytest.raises(OSError) as err, _disk_full_line(tmp_path / "s.npz.json", tmp_path / "s.npz", "finish it"):
        with open("/dev/full", "w") as f:
            f.write("x")
            f.flush()
    assert one_line(err).startswith(f"cannot write {tmp_path / 's.npz.json'}: No space left on device (disk full?)")
    assert "Errno" not in str(err.value)
