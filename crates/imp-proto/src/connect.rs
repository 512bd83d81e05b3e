//! The hybrid-vsock `CONNECT` line, as Firecracker defines it and the QEMU driver's mux speaks
//! it: the host writes `CONNECT <port>\n` on the VMM's vsock Unix socket and the VMM answers
//! `OK <host port>\n` once the guest accepted; what follows the newline is the guest's stream.
//! The one client that speaks it is imp-vmm's `vsock::connect`; the line's format and the
//! answer's parse are here, pure, so the fuzz targets reach them without a VMM.

/// The longest answer a VMM sends (`OK ` and a 32-bit port); a longer line is not one.
pub const MAX_REPLY: usize = 32;

/// The request that opens guest `port`.
pub fn request(port: u32) -> String {
    format!("CONNECT {port}\n")
}

/// The host port an answer line (without its newline) names, or the line as the reason it is
/// not an acceptance.
pub fn reply(line: &[u8]) -> Result<u32, String> {
    let text = String::from_utf8_lossy(line);
    text.strip_prefix("OK ")
        .and_then(|n| n.trim().parse::<u32>().ok())
        .ok_or_else(|| text.into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_ok_line_names_the_host_port_and_anything_else_is_refused() {
        assert_eq!(request(10000), "CONNECT 10000\n");
        assert_eq!(reply(b"OK 1073741824"), Ok(1_073_741_824));
        assert_eq!(reply(b"OK 5 "), Ok(5));
        assert_eq!(reply(b"ERR no listener"), Err("ERR no listener".into()));
        assert_eq!(reply(b"OK"), Err("OK".into()));
        assert_eq!(reply(b"OK 99999999999"), Err("OK 99999999999".into()));
        assert!(reply(b"\xffOK 1").is_err());
    }
}
