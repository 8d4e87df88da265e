"""Whether a tensor's memory is a mapping of a given file (Linux ``/proc/self/maps``)."""
from pathlib import Path

import torch


def is_mapped_from(tensor: torch.Tensor, path: Path) -> bool:
    address = tensor.untyped_storage().data_ptr()
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 6 and Path(fields[5]) == Path(path).resolve():
                start, end = (int(x, 16) for x in fields[0].split("-"))
                if start <= address < end:
                    return True
    return False
