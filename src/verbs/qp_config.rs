//! A queue pair's settings: queue depths, access rights and the RC
//! transport's timeout and retry counts, checked against what the wire can
//! carry.

use crate::error::{Error, Result};

use super::mr::AccessFlags;

/// How to build and connect an RC queue pair. `Default` suits most uses.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct QpConfig {
    /// Port to use (1-based); `None` picks the first ACTIVE port.
    pub port: Option<u8>,
    /// GID index to use; `None` picks one (see [`Context::select_gid`](super::Context::select_gid)).
    pub gid_index: Option<u32>,
    /// Send-queue depth.
    pub max_send_wr: u32,
    /// Receive-queue depth.
    pub max_recv_wr: u32,
    /// Scatter/gather entries per send request.
    pub max_send_sge: u32,
    /// Scatter/gather entries per receive request.
    pub max_recv_sge: u32,
    /// Inline payload size to ask for (the provider may grant more).
    pub max_inline_data: u32,
    /// What the peer may do to this QP's memory: `REMOTE_WRITE` and/or
    /// `REMOTE_READ`. Empty by default (least privilege).
    pub remote_access: AccessFlags,
    /// Outstanding READs this QP may issue (and serve, as a target); clamped
    /// to what the device supports.
    pub max_rd_atomic: u8,
    /// Local ACK timeout exponent (0 to 31, default 14): a request not
    /// acknowledged within 4.096 µs × 2^`timeout` is sent again (14: 67 ms;
    /// 18: 1.07 s). 0 means wait forever, so a dead peer is never noticed
    /// by the QP. Larger values are refused ([`validate`](Self::validate)):
    /// the field is 5 bits on the wire, and rxe does not check it (from 41
    /// on its timer computation overflows).
    ///
    /// With [`retry_cnt`](Self::retry_cnt) it bounds how long a QP takes to
    /// notice a peer that stopped answering while requests are in flight:
    /// after at least (`retry_cnt` + 1) × 4.096 µs × 2^`timeout` (with the
    /// defaults 8 × 67 ms ≈ 0.54 s) the request completes with
    /// `IBV_WC_RETRY_EXC_ERR`, the QP goes to the error state and the
    /// reactor hands the handler an [`Error::Completion`] naming the QP and
    /// the peer. That figure is a lower bound: the InfiniBand specification
    /// lets the transport timer fire up to about 4 times later than
    /// 4.096 µs × 2^`timeout`, and providers round it up (Soft-RoCE (rxe)
    /// uses the kernel's jiffies and its own retransmit logic; the README's
    /// "Faults across hosts" has the times measured across guests). A QP
    /// with nothing in flight notices nothing: an idle session learns of a
    /// dead peer from its control connection (keepalive, 20 s).
    ///
    /// QPs connected through the connection manager
    /// ([`cm::CmId::create_qp`](super::cm::CmId::create_qp)) ignore this
    /// field: `rdma_init_qp_attr` computes their ACK timeout from the path
    /// (its packet lifetime), as librdmacm does for its own QPs.
    pub timeout: u8,
    /// Transport retries (0 to 7, default 7) after an ACK timeout or a
    /// sequence error NAK before the request fails with
    /// `IBV_WC_RETRY_EXC_ERR`; see [`timeout`](Self::timeout). In the
    /// InfiniBand specification 7 is a count, unlike
    /// [`rnr_retry`](Self::rnr_retry)'s "forever", but Soft-RoCE (rxe)
    /// treats `retry_cnt` 7 as "retry forever" too (its completer counts
    /// down for any value other than 7): with the default a QP on rxe never
    /// reports a dead peer, and only the control connection does
    /// (keepalive, 20 s). Ask for 6 or less where the QP itself must
    /// notice (the tools' `--retry-cnt`). Values above 7 are refused
    /// ([`validate`](Self::validate)): the field is 3 bits on the wire,
    /// and rxe, which does not check it, would count down from 8 to 255.
    pub retry_cnt: u8,
    /// RNR retries (0 to 7, default 7 = forever): how often a SEND the peer
    /// had no receive posted for is tried again before it fails with
    /// `IBV_WC_RNR_RETRY_EXC_ERR`. The reactor's credits keep its own
    /// peers from RNR; keep 7 on the peers of an SRQ reactor (see the
    /// README's shared receive queue section). Values above 7 are refused
    /// ([`validate`](Self::validate)).
    pub rnr_retry: u8,
    /// Minimum RNR NAK timer code advertised to the peer (0 to 31, default
    /// 12: 0.64 ms): how long the peer waits before retrying a SEND we had
    /// no receive for. Values above 31 are refused
    /// ([`validate`](Self::validate)): the code is 5 bits of the AETH, and
    /// rxe, which does not check it, would spill it into the AETH's other
    /// bits.
    pub min_rnr_timer: u8,
    /// Initial send PSN; `None` draws a random one.
    pub psn: Option<u32>,
}

impl Default for QpConfig {
    fn default() -> Self {
        Self {
            port: None,
            gid_index: None,
            max_send_wr: 256,
            max_recv_wr: 256,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 64,
            remote_access: AccessFlags::empty(),
            // perftest's choice: deep enough that READs pipeline.
            max_rd_atomic: 16,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            min_rnr_timer: 12,
            psn: None,
        }
    }
}

impl QpConfig {
    /// Largest [`timeout`](Self::timeout): a 5-bit field.
    pub const MAX_TIMEOUT: u8 = 31;
    /// Largest [`retry_cnt`](Self::retry_cnt): a 3-bit field.
    pub const MAX_RETRY_CNT: u8 = 7;
    /// Largest [`rnr_retry`](Self::rnr_retry): a 3-bit field.
    pub const MAX_RNR_RETRY: u8 = 7;
    /// Largest [`min_rnr_timer`](Self::min_rnr_timer): a 5-bit code.
    pub const MAX_MIN_RNR_TIMER: u8 = 31;

    /// Checks the transport settings against the ranges their fields have
    /// on the wire. A QP is created ([`ProtectionDomain::create_qp`](super::ProtectionDomain::create_qp),
    /// [`cm::CmId::create_qp`](super::cm::CmId::create_qp)) and connected
    /// only with a configuration that passes: providers need not check
    /// (rxe does not), and an out-of-range value would otherwise be
    /// truncated or misread silently. The error names the field, its value
    /// and the maximum.
    pub fn validate(&self) -> Result<()> {
        let limits = [
            ("timeout", self.timeout, Self::MAX_TIMEOUT),
            ("retry_cnt", self.retry_cnt, Self::MAX_RETRY_CNT),
            ("rnr_retry", self.rnr_retry, Self::MAX_RNR_RETRY),
            ("min_rnr_timer", self.min_rnr_timer, Self::MAX_MIN_RNR_TIMER),
        ];
        for (field, value, max) in limits {
            if value > max {
                return Err(Error::QpConfigOutOfRange { field, value, max });
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The field an out-of-range setting was refused for, with its value
    /// and maximum.
    fn refused(config: &QpConfig) -> Option<(&'static str, u8, u8)> {
        match config.validate() {
            Ok(()) => None,
            Err(Error::QpConfigOutOfRange { field, value, max }) => Some((field, value, max)),
            Err(other) => panic!("not a QpConfigOutOfRange: {other}"),
        }
    }

    #[test]
    fn the_defaults_are_in_range() {
        assert_eq!(refused(&QpConfig::default()), None);
    }

    #[test]
    fn each_setting_is_accepted_at_its_maximum_and_refused_above_it() {
        type Field = fn(&mut QpConfig) -> &mut u8;
        let fields: [(&str, u8, Field); 4] = [
            ("timeout", 31, |c| &mut c.timeout),
            ("retry_cnt", 7, |c| &mut c.retry_cnt),
            ("rnr_retry", 7, |c| &mut c.rnr_retry),
            ("min_rnr_timer", 31, |c| &mut c.min_rnr_timer),
        ];
        for (name, max, field) in fields {
            let mut config = QpConfig::default();
            *field(&mut config) = 0;
            assert_eq!(refused(&config), None, "{name} = 0");
            *field(&mut config) = max;
            assert_eq!(refused(&config), None, "{name} = {max}");
            *field(&mut config) = max + 1;
            assert_eq!(
                refused(&config),
                Some((name, max + 1, max)),
                "{name} = {}",
                max + 1
            );
            *field(&mut config) = u8::MAX;
            assert_eq!(refused(&config), Some((name, u8::MAX, max)), "{name} = 255");
        }
    }

    #[test]
    fn the_error_names_the_field_the_value_and_the_maximum() {
        let config = QpConfig {
            timeout: 41,
            ..QpConfig::default()
        };
        assert_eq!(
            config.validate().unwrap_err().to_string(),
            "invalid QP configuration: timeout = 41 is out of range (at most 31)"
        );
    }
}
