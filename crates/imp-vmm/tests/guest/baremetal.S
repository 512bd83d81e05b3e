# imp's bare-metal test guest for Firecracker (x86_64, entered in 64-bit mode, stack set).
# Built by tests/firecracker.rs: as baremetal.S -o g.o && ld -nostdlib -static -Ttext=0x200000 -e _start
# Prints a banner, then "tick N" on COM1 about ten times a second, the counter kept in r12 so a
# snapshot restore continues it. A key press on the i8042 (Firecracker's SendCtrlAltDel) makes it
# reset the machine through the i8042 (0xfe to port 0x64), which makes Firecracker exit: a
# graceful shutdown.
    .code64
    .text
    .globl _start
_start:
    lea banner(%rip), %rsi
    call puts
    xor %r12, %r12
tick:
    lea ticktext(%rip), %rsi
    call puts
    mov %r12, %rax
    call putdec
    mov $'\n', %al
    call putc
    inc %r12
    in $0x64, %al              # i8042 status: bit 0 = a key code is waiting
    test $1, %al
    jnz shutdown
    rdtsc                      # busy-wait about 0x10000000 TSC cycles (~0.1 s)
    shl $32, %rdx
    or %rax, %rdx
    mov %rdx, %rbx
    add $0x10000000, %rbx
wait:
    pause
    rdtsc
    shl $32, %rdx
    or %rax, %rdx
    cmp %rbx, %rdx
    jb wait
    jmp tick
shutdown:
    lea byetext(%rip), %rsi
    call puts
    mov $0xfe, %al
    out %al, $0x64
halt:
    hlt
    jmp halt

putc:                          # al -> COM1
    mov $0x3f8, %dx
    out %al, %dx
    ret
puts:                          # rsi -> NUL-terminated string
    lodsb
    test %al, %al
    jz 1f
    call putc
    jmp puts
1:  ret
putdec:                        # rax -> decimal digits
    mov $10, %rcx
    xor %r8, %r8
1:  xor %rdx, %rdx
    div %rcx
    push %rdx
    inc %r8
    test %rax, %rax
    jnz 1b
2:  pop %rax
    add $'0', %al
    call putc
    dec %r8
    jnz 2b
    ret

banner:   .asciz "IMP BAREMETAL GUEST\n"
ticktext: .asciz "tick "
byetext:  .asciz "IMP GUEST RESET\n"
