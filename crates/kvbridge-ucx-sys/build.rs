//! Generates the `ucp` bindings from the installed UCX headers (feature `ucx` only).

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=wrapper.h");
    println!("cargo:rerun-if-env-changed=UCX_INCLUDE_DIR");
    println!("cargo:rerun-if-env-changed=UCX_LIB_DIR");
    #[cfg(feature = "ucx")]
    generate();
}

#[cfg(feature = "ucx")]
fn generate() {
    use std::path::PathBuf;

    let include = std::env::var("UCX_INCLUDE_DIR").unwrap_or_else(|_| "/usr/include".into());
    let header = PathBuf::from(&include).join("ucp/api/ucp.h");
    if !header.exists() {
        // A build script cannot return an error; this message is what the user sees.
        panic!(
            "kvbridge-ucx-sys (feature `ucx`): UCX headers not found at {}. Install them with \
             `apt-get install libucx-dev libclang-dev` (scripts/setup.sh does), or set \
             UCX_INCLUDE_DIR / UCX_LIB_DIR to a UCX install, or build without the `ucx` feature.",
            header.display()
        );
    }
    if let Ok(dir) = std::env::var("UCX_LIB_DIR") {
        println!("cargo:rustc-link-search=native={dir}");
    }
    println!("cargo:rustc-link-lib=dylib=ucp");
    println!("cargo:rustc-link-lib=dylib=ucs");

    let bindings = bindgen::Builder::default()
        .header("wrapper.h")
        .clang_arg(format!("-I{include}"))
        .allowlist_function("ucp_(init_version|cleanup|config_read|config_release|config_modify)")
        .allowlist_function("ucp_worker_(create|destroy|get_address|release_address|get_efd|arm|progress|signal)")
        .allowlist_function("ucp_ep_(create|close_nbx|flush_nbx|rkey_unpack|print_info)")
        .allowlist_function("ucp_(mem_map|mem_unmap|rkey_pack|rkey_buffer_release|rkey_destroy)")
        .allowlist_function("ucp_(put_nbx|get_nbx|request_check_status|request_free)")
        .allowlist_function("ucs_status_string")
        .allowlist_type("ucs_status_t")
        .allowlist_var("UCP_API_(MAJOR|MINOR)")
        .allowlist_var("UCS_ERR_LAST")
        // Enums whose members are OR-ed into field masks stay plain integer constants.
        .constified_enum("ucp_.*")
        .constified_enum("ucs_status_t")
        .constified_enum("ucs_thread_mode_t")
        .constified_enum("ucs_memory_type")
        .allowlist_type("ucp_(params_field|feature|worker_params_field|ep_params_field|err_handling_mode_t|mem_map_params_field|op_attr_t|ep_close_flags_t|mem_map_flags)")
        .allowlist_type("ucs_thread_mode_t")
        .prepend_enum_name(false)
        .derive_default(true)
        .layout_tests(false)
        .generate_comments(false)
        .parse_callbacks(Box::new(bindgen::CargoCallbacks::new()))
        .generate()
        .expect("kvbridge-ucx-sys: bindgen could not parse ucp/api/ucp.h");
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    bindings
        .write_to_file(out.join("ucp.rs"))
        .expect("kvbridge-ucx-sys: cannot write the bindings to OUT_DIR");
}
