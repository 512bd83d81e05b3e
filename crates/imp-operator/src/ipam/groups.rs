//! Group CIDRs carved from a network's subnet, as the Go project carves them.
//!
//! Groups are taken in name order; each gets the smallest block holding `expectedSize + 2`
//! addresses (at least a /30), aligned to its size, placed consecutively from the subnet's
//! start.

use imp_api::ipv4::Ipv4Cidr;
use imp_api::network::{GroupCidr, NetworkGroup};
use imp_api::validation::group_block;

/// The groups do not fit into the subnet.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("group {group} (a block of {block} addresses) does not fit into subnet {subnet}")]
pub struct CarveError {
    /// The first group that did not fit.
    pub group: String,
    /// Its block size.
    pub block: u64,
    /// The subnet.
    pub subnet: Ipv4Cidr,
}

/// The CIDR of every group of `subnet`, in name order.
pub fn carve(
    subnet: Ipv4Cidr,
    groups: &[NetworkGroup],
) -> Result<Vec<(String, Ipv4Cidr)>, CarveError> {
    let mut sorted: Vec<&NetworkGroup> = groups.iter().collect();
    sorted.sort_by(|a, b| a.name.cmp(&b.name));
    let mut cursor = 0u64;
    let mut out = Vec::with_capacity(sorted.len());
    for g in sorted {
        let block = group_block(g.expected_size.max(1));
        let start = cursor.div_ceil(block) * block;
        let misfit = || CarveError {
            group: g.name.clone(),
            block,
            subnet,
        };
        if start + block > subnet.size() {
            return Err(misfit());
        }
        let prefix = 32 - u8::try_from(block.trailing_zeros()).map_err(|_| misfit())?;
        let first = subnet.nth(start).ok_or_else(misfit)?;
        let cidr = Ipv4Cidr::containing(first, prefix).ok_or_else(misfit)?;
        out.push((g.name.clone(), cidr));
        cursor = start + block;
    }
    Ok(out)
}

/// [`carve`] in the status shape (`status.groupCIDRs`).
pub fn status_shape(carved: &[(String, Ipv4Cidr)]) -> Vec<GroupCidr> {
    carved
        .iter()
        .map(|(name, cidr)| GroupCidr {
            name: name.clone(),
            cidr: cidr.to_string(),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn group(name: &str, size: i32) -> NetworkGroup {
        NetworkGroup {
            name: name.into(),
            expected_size: size,
            ..Default::default()
        }
    }

    #[test]
    fn groups_are_sorted_sized_and_aligned_from_the_start() {
        let net: Ipv4Cidr = "10.0.0.0/24".parse().unwrap();
        let carved = carve(net, &[group("web", 14), group("db", 2), group("api", 30)]).unwrap();
        let shown: Vec<(String, String)> = carved
            .iter()
            .map(|(n, c)| (n.clone(), c.to_string()))
            .collect();
        assert_eq!(
            shown,
            [
                ("api".into(), "10.0.0.0/27".into()),
                ("db".into(), "10.0.0.32/30".into()),
                // 16-address block aligned up past db's /30.
                ("web".into(), "10.0.0.48/28".into()),
            ]
        );
    }

    #[test]
    fn groups_that_do_not_fit_are_refused_naming_the_group() {
        let net: Ipv4Cidr = "10.0.0.0/28".parse().unwrap();
        let err = carve(net, &[group("a", 2), group("b", 14)]).unwrap_err();
        assert_eq!(err.group, "b");
        assert!(err.to_string().contains("10.0.0.0/28"));
        assert!(carve(net, &[]).unwrap().is_empty());
    }
}
