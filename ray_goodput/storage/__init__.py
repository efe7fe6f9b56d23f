"""Storage: any ``pyarrow.fs`` URI, parallel retried transfers, listing and deletion."""

from ray_goodput.storage._checksum import (
    BLOCK_BYTES,
    CHUNK_BYTES,
    CRC32,
    CRC32C,
    DEFAULT_ALGORITHM,
    REMOTE_READ_BYTES,
    checksum,
    combine_checksums,
    copy_stream,
    file_crc32,
    upload_block_bytes,
)
from ray_goodput.storage._retry import RetryPolicy, is_transient
from ray_goodput.storage._transfer import (
    FileEntry,
    delete_dir,
    download_file,
    download_files,
    link_local_file,
    list_dir,
    object_crc32,
    read_bytes,
    upload_file,
    upload_files,
    write_bytes,
    write_local_file,
)
from ray_goodput.storage._uri import StorageLocation, resolve
from ray_goodput.storage._written import ChecksummedWrite, Written

__all__ = [
    "BLOCK_BYTES",
    "CHUNK_BYTES",
    "CRC32",
    "CRC32C",
    "ChecksummedWrite",
    "DEFAULT_ALGORITHM",
    "FileEntry",
    "REMOTE_READ_BYTES",
    "RetryPolicy",
    "StorageLocation",
    "Written",
    "checksum",
    "combine_checksums",
    "copy_stream",
    "delete_dir",
    "download_file",
    "download_files",
    "file_crc32",
    "is_transient",
    "link_local_file",
    "list_dir",
    "object_crc32",
    "read_bytes",
    "resolve",
    "upload_block_bytes",
    "upload_file",
    "upload_files",
    "write_bytes",
    "write_local_file",
]
