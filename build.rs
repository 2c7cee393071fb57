//! Generates the FFI bindings to libibverbs and, with the `rdma_cm` feature,
//! librdmacm (the RDMA connection manager, `<rdma/rdma_cma.h>`) from the
//! system's rdma-core headers.
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

const VERBS_HEADER: &str = "infiniband/verbs.h";
const CM_HEADER: &str = "rdma/rdma_cma.h";
/// What `src/sys/wrapper.h` includes `<rdma/rdma_cma.h>` under.
const CM_DEFINE: &str = "RDMA_COMM_CORE_CM";
const INSTALL_HINT: &str = "install the Debian packages libibverbs-dev and (for the rdma_cm \
     feature) librdmacm-dev (rdma-core headers), libclang-dev (for bindgen), pkg-config, libhwloc-dev and \
     ibverbs-providers, or set RDMA_CORE_INCLUDE_DIR (and RDMA_CORE_LIB_DIR) to an \
     rdma-core installation of your own";
/// A directory holding `infiniband/verbs.h` (and `rdma/rdma_cma.h`), searched
/// before pkg-config's and the system's.
const INCLUDE_DIR_ENV: &str = "RDMA_CORE_INCLUDE_DIR";
/// A directory holding `libibverbs.so` and `librdmacm.so`, searched first
/// at link time.
const LIB_DIR_ENV: &str = "RDMA_CORE_LIB_DIR";
/// Set (or docs.rs's `DOCS_RS`): use the bindings kept in `src/sys`, compile
/// no shim and link nothing, so `cargo doc` and `cargo check` work on a host
/// without rdma-core. Such a build cannot run.
const DOCS_ONLY_ENV: &str = "RDMA_COMM_CORE_DOCS_ONLY";
/// The bindings bindgen makes from the headers this crate is tested with;
/// `sys::tests::kept_bindings_match_the_headers` compares them to a fresh
/// generation.
const KEPT_BINDINGS: &str = "src/sys/bindings.rs";

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=src/sys/wrapper.h");
    println!("cargo:rerun-if-changed={KEPT_BINDINGS}");
    for var in [INCLUDE_DIR_ENV, LIB_DIR_ENV, DOCS_ONLY_ENV, "DOCS_RS"] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    let out_dir = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR"));

    if env::var_os(DOCS_ONLY_ENV).is_some() || env::var_os("DOCS_RS").is_some() {
        std::fs::copy(KEPT_BINDINGS, out_dir.join("verbs.rs"))
            .unwrap_or_else(|err| panic!("rdma-comm-core: copying {KEPT_BINDINGS}: {err}"));
        return;
    }

    let with_cm = env::var_os("CARGO_FEATURE_RDMA_CM").is_some();
    let headers: &[&str] = if with_cm {
        &[VERBS_HEADER, CM_HEADER]
    } else {
        &[VERBS_HEADER]
    };
    let (include_dirs, lib_dirs) = search_dirs();
    for header in headers {
        if !include_dirs.iter().any(|dir| dir.join(header).exists()) {
            panic!("rdma-comm-core: <{header}> not found in {include_dirs:?}; {INSTALL_HINT}");
        }
    }

    let shim_path = out_dir.join("verbs_static_inline_shim");
    let bindings = bindgen::Builder::default()
        .header("src/sys/wrapper.h")
        .clang_args(
            include_dirs
                .iter()
                .map(|dir| format!("-I{}", dir.display())),
        )
        .clang_args(with_cm.then(|| format!("-D{CM_DEFINE}")))
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
            panic!("rdma-comm-core: bindgen failed on {headers:?} ({err}); {INSTALL_HINT}")
        });
    bindings
        .write_to_file(out_dir.join("verbs.rs"))
        .expect("write bindings to OUT_DIR");

    let mut shim = cc::Build::new();
    shim.file(shim_path.with_extension("c"))
        .include(env::current_dir().expect("build script has a working directory"))
        .include("src/sys");
    for dir in &include_dirs {
        shim.include(dir);
    }
    if with_cm {
        shim.define(CM_DEFINE, None);
    }
    shim.opt_level(2)
        .warnings(false)
        .compile("verbs_static_inline_shim");

    for dir in &lib_dirs {
        println!("cargo:rustc-link-search=native={}", dir.display());
    }
    println!("cargo:rustc-link-lib=ibverbs");
    if with_cm {
        println!("cargo:rustc-link-lib=rdmacm");
    }
}

/// Where the headers and libraries are: the override's, then pkg-config's
/// (`libibverbs`, `librdmacm`), then the system's.
fn search_dirs() -> (Vec<PathBuf>, Vec<PathBuf>) {
    let mut include_dirs = Vec::new();
    let mut lib_dirs = Vec::new();
    if let Some(dir) = env::var_os(INCLUDE_DIR_ENV) {
        include_dirs.push(PathBuf::from(dir));
    }
    if let Some(dir) = env::var_os(LIB_DIR_ENV) {
        lib_dirs.push(PathBuf::from(dir));
    }
    for library in ["libibverbs", "librdmacm"] {
        // Without pkg-config or its files, the system's directories below.
        if let Ok(found) = pkg_config::Config::new()
            .cargo_metadata(false)
            .env_metadata(false)
            .probe(library)
        {
            add_new(&mut include_dirs, found.include_paths);
            add_new(&mut lib_dirs, found.link_paths);
        }
    }
    add_new(
        &mut include_dirs,
        ["/usr/include", "/usr/local/include"].map(PathBuf::from),
    );
    (include_dirs, lib_dirs)
}

fn add_new(dirs: &mut Vec<PathBuf>, more: impl IntoIterator<Item = PathBuf>) {
    for dir in more {
        if !dirs.contains(&dir) {
            dirs.push(dir);
        }
    }
}
