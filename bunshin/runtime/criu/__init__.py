"""Running CRIU: the dump and restore runs, the swrk protocol, its kernel facts (kdat), how it is
launched, the warm helper (zygote, prepared), network namespace images, joined namespaces, the
CPU boosts around a freeze, a restore and a fork, a clone's own images folder and the owner of
its user namespace (clone_images, userns_owner.c), and the check that restored processes are
alive.

May import: container, memfile, kernel, state; never snapshot or upkeep.
"""
