//! Misuses the types rule out: every file in `tests/compile_fail/` must fail
//! to compile, with the error its `.stderr` file records (regenerate them
//! with `TRYBUILD=overwrite cargo test --test compile_fail`, then read them:
//! each must fail for the reason its `//!` line gives).
//!
//! Needs no RDMA device, so it runs on the host with every `cargo test`.

#[test]
fn misuses_do_not_compile() {
    trybuild::TestCases::new().compile_fail("tests/compile_fail/*.rs");
}
