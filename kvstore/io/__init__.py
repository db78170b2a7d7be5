"""The data path of one rank between host staging memory and its slot files: data
directories and their health, staging memory, the device streams that keep each ring's
queue full, I/O statistics and kvstore's own threads (`rank.RankIO`). Drives the Cython
core (`kvstore._ring`, `kvstore._slotfile`, `kvstore._hostbuf`); never touches the index."""
