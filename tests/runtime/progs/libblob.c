/*
 * libblob: a shared library whose initialized data is a binary file, for the
 * tests of written private file mappings.
 *
 *   gcc -shared -fPIC -DBLOB='"/path/to/blob"' -o libblob.so libblob.c
 *
 * The blob lands in .data (a writable, file-backed, private mapping once the
 * library is loaded), page-aligned, between the symbols lib_blob and
 * lib_blob_end.
 */
#ifndef BLOB
#error "build with -DBLOB='\"/path/to/blob\"'"
#endif

__asm__(
    ".section .data\n"
    ".balign 4096\n"
    ".globl lib_blob\n"
    ".type lib_blob, @object\n"
    "lib_blob:\n"
    ".incbin \"" BLOB "\"\n"
    ".globl lib_blob_end\n"
    "lib_blob_end:\n"
    ".previous\n");
