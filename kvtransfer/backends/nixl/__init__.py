"""The NIXL (UCX) backend: ``transport`` moves the blocks, ``api`` finds the installed NIXL build."""
