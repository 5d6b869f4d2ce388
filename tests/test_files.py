"""The one reader of user text files and check of output paths (issue #46): a file that is not
UTF-8 names the byte offset; an output path that is a file, or runs through one, is refused
without creating anything."""

from __future__ import annotations

import pytest

from kvgate.errors import KVGateError
from kvgate.files import UserFileError, check_output_dir, read_user_text


def test_text_is_read_as_utf8_with_or_without_a_byte_order_mark(tmp_path):
    path = tmp_path / "t.txt"
    path.write_bytes("\ufeffna\u00efve".encode())
    assert read_user_text(path) == "na\u00efve"


@pytest.mark.parametrize("data, offset", [(b"caf\xe9", 3), (b"\xef\xbb\xbfab\xff", 5)])
def test_bytes_that_are_not_utf8_are_named_by_their_offset_in_the_file(tmp_path, data, offset):
    path = tmp_path / "t.txt"
    path.write_bytes(data)
    with pytest.raises(UserFileError, match=f"--flag {path}: not UTF-8 text .* at offset "
                                            f"{offset}\\)"):
        read_user_text(path, "--flag")
    assert issubclass(UserFileError, KVGateError)


def test_missing_files_and_folders_are_one_line(tmp_path):
    with pytest.raises(UserFileError, match="no such file"):
        read_user_text(tmp_path / "missing.txt", "--flag")
    with pytest.raises(UserFileError, match="is a folder, not a text file"):
        read_user_text(tmp_path, "--flag")


def test_an_output_path_that_is_a_file_or_inside_one_is_refused_and_nothing_made(tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(UserFileError, match="--out .*afile: is a file, not a folder"):
        check_output_dir(tmp_path / "afile", "--out")
    below = tmp_path / "afile" / "a" / "b"
    with pytest.raises(UserFileError, match=f"{tmp_path / 'afile'} is a file, so no folder"):
        check_output_dir(below, "--out")
    assert check_output_dir(tmp_path / "new" / "deeper", "--out") == tmp_path / "new" / "deeper"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]
