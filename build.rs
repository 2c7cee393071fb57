//! Generates the FFI bindings to libibverbs and librdmacm (the RDMA
//! connection manager, `<rdma/rdma_cma.h>`) from the system's rdma-core headers.
//!
//! Static inline verbs: `ibv_post_send`, `ibv_post_recv`, `ibv_poll_cq` and
//! `ibv_req_notify_cq` are one indirect call through `context->ops` in the
//! header. The safe layer reads those function pointers once when a QP or CQ is
//! created and calls them directly, which is exactly what the inline C does, so
//! the hot path pays no wrapper call. Every other static inline (query_port,
//! query_gid_ex, create_cq_ex, ...) is cold; for those bindgen's
//! `wrap_static_fns` emits a C shim that `cc` compiles here, so we never
//! re-implement header logic that changes between rdma-core releases.

use std::env;
use std::path::PathBuf;

const HEADERS: [&str; 2] = ["infiniband/verbs.h", "rdma/rdma_cma.h"];
const INSTALL_HINT: &str = "install the Debian packages libibverbs-dev and librdmacm-dev \
     (rdma-core headers), libclang-dev (for bindgen) and ibverbs-providers: \
     `apt-get install libibverbs-dev librdmacm-dev libclang-dev ibverbs-providers`";

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=src/sys/wrapper.h");

    for header in HEADERS {
        let found = ["/usr/include", "/usr/local/include"]
            .iter()
            .any(|dir| PathBuf::from(dir).join(header).exists());
        if !found {
            panic!("rdma-comm-core: <{header}> not found; {INSTALL_HINT}");
        }
    }

    let out_dir = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let shim_path = out_dir.join("verbs_static_inline_shim");

    let bindings = bindgen::Builder::default()
        .header("src/sys/wrapper.h")
        .allowlist_function("ibv_.*|_ibv_.*|___ibv_.*|rdma_.*")
        .allowlist_type("ibv_.*|rdma_.*")
        .allowlist_var("IBV_.*|RDMA_.*")
        .default_enum_style(bindgen::EnumVariation::Consts)
        .derive_default(true)
        .derive_debug(true)
        .impl_debug(false)
        .prepend_enum_name(false)
        .wrap_static_fns(true)
        .wrap_static_fns_path(&shim_path)
        .layout_tests(true)
        .generate()
        .unwrap_or_else(|err| {
            panic!("rdma-comm-core: bindgen failed on {HEADERS:?} ({err}); {INSTALL_HINT}")
        });
    bindings
        .write_to_file(out_dir.join("verbs.rs"))
        .expect("write bindings to OUT_DIR");

    cc::Build::new()
        .file(shim_path.with_extension("c"))
        .include(env::current_dir().expect("build script has a working directory"))
        .include("src/sys")
        .opt_level(2)
        .warnings(false)
        .compile("verbs_static_inline_shim");

    println!("cargo:rustc-link-lib=ibverbs");
    println!("cargo:rustc-link-lib=rdmacm");
}
