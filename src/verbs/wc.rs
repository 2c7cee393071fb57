//! The codes a work completion reports: its status and its opcode, named
//! as in rdma-core.

use std::fmt;

/// A completion status (`IBV_WC_*`). The values are rdma-core's
/// `enum ibv_wc_status` (a verbs test checks them against the bindings).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct WcStatus(pub u32);

/// The operation a completion reports (`IBV_WC_*` opcodes, rdma-core's
/// `enum ibv_wc_opcode`).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct WcOpcode(pub u32);

macro_rules! named_constants {
    ($ty:ident { $($name:ident = $value:expr),* $(,)? }) => {
        #[allow(missing_docs)]
        impl $ty {
            $(pub const $name: Self = Self($value);)*

            /// The verbs name of this value, e.g. `IBV_WC_REM_ACCESS_ERR`.
            pub fn name(self) -> &'static str {
                match self.0 {
                    $(v if v == $value => concat!("IBV_WC_", stringify!($name)),)*
                    _ => "IBV_WC_(unknown)",
                }
            }
        }

        impl fmt::Debug for $ty {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.name())
            }
        }

        impl fmt::Display for $ty {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.name())
            }
        }
    };
}

named_constants!(WcStatus {
    SUCCESS = 0,
    LOC_LEN_ERR = 1,
    LOC_QP_OP_ERR = 2,
    LOC_EEC_OP_ERR = 3,
    LOC_PROT_ERR = 4,
    WR_FLUSH_ERR = 5,
    MW_BIND_ERR = 6,
    BAD_RESP_ERR = 7,
    LOC_ACCESS_ERR = 8,
    REM_INV_REQ_ERR = 9,
    REM_ACCESS_ERR = 10,
    REM_OP_ERR = 11,
    RETRY_EXC_ERR = 12,
    RNR_RETRY_EXC_ERR = 13,
    LOC_RDD_VIOL_ERR = 14,
    REM_INV_RD_REQ_ERR = 15,
    REM_ABORT_ERR = 16,
    INV_EECN_ERR = 17,
    INV_EEC_STATE_ERR = 18,
    FATAL_ERR = 19,
    RESP_TIMEOUT_ERR = 20,
    GENERAL_ERR = 21,
});

named_constants!(WcOpcode {
    SEND = 0,
    RDMA_WRITE = 1,
    RDMA_READ = 2,
    COMP_SWAP = 3,
    FETCH_ADD = 4,
    BIND_MW = 5,
    LOCAL_INV = 6,
    RECV = 128,
    RECV_RDMA_WITH_IMM = 129,
});
