from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RowDtype(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROW_DTYPE_UNSPECIFIED: _ClassVar[RowDtype]
    ROW_DTYPE_FLOAT8_E4M3FN: _ClassVar[RowDtype]
    ROW_DTYPE_BFLOAT16: _ClassVar[RowDtype]
ROW_DTYPE_UNSPECIFIED: RowDtype
ROW_DTYPE_FLOAT8_E4M3FN: RowDtype
ROW_DTYPE_BFLOAT16: RowDtype

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TableInfo(_message.Message):
    __slots__ = ("tensor_name", "num_rows", "row_width", "row_bytes", "dtype", "scale", "header_sha256", "shm_name", "generation", "shm_dir")
    TENSOR_NAME_FIELD_NUMBER: _ClassVar[int]
    NUM_ROWS_FIELD_NUMBER: _ClassVar[int]
    ROW_WIDTH_FIELD_NUMBER: _ClassVar[int]
    ROW_BYTES_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SCALE_FIELD_NUMBER: _ClassVar[int]
    HEADER_SHA256_FIELD_NUMBER: _ClassVar[int]
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    SHM_DIR_FIELD_NUMBER: _ClassVar[int]
    tensor_name: str
    num_rows: int
    row_width: int
    row_bytes: int
    dtype: RowDtype
    scale: float
    header_sha256: bytes
    shm_name: str
    generation: int
    shm_dir: str
    def __init__(self, tensor_name: _Optional[str] = ..., num_rows: _Optional[int] = ..., row_width: _Optional[int] = ..., row_bytes: _Optional[int] = ..., dtype: _Optional[_Union[RowDtype, str]] = ..., scale: _Optional[float] = ..., header_sha256: _Optional[bytes] = ..., shm_name: _Optional[str] = ..., generation: _Optional[int] = ..., shm_dir: _Optional[str] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("row_ids_le_i64",)
    ROW_IDS_LE_I64_FIELD_NUMBER: _ClassVar[int]
    row_ids_le_i64: bytes
    def __init__(self, row_ids_le_i64: _Optional[bytes] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("rows", "generation")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    rows: bytes
    generation: int
    def __init__(self, rows: _Optional[bytes] = ..., generation: _Optional[int] = ...) -> None: ...
