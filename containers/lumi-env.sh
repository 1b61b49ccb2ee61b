# shellcheck shell=sh
# containers/lumi-env.sh - the library path of the LUMI image, sourced by its %environment
# (copied in as /opt/pww/lumi-env.sh) every time the container starts. POSIX sh: the
# image's /bin/sh is dash.
#
# Why: the image is Ubuntu, whose loader searches /usr/lib/x86_64-linux-gnu, never the
# SUSE-style /usr/lib64 where LUMI's host libraries sit. The Slingshot stack comes from the
# host through binds (sites/lumi.sh's PWW_CONTAINER_BINDS): Cray's libfabric, with its CXI
# provider, under /opt/cray/libfabric/<version>/lib64, and the libcxi it links against as
# /usr/lib64/libcxi.so.1. RCCL loads its network plugin, librccl-net.so (aws-ofi-nccl,
# built into the image under /opt/aws-ofi-nccl), by name through LD_LIBRARY_PATH, and the
# plugin then loads libfabric.so.1 the same way. So, in this order:
#   1. $PWW_RCCL_PLUGIN_DIR, when set: a host-built plugin that replaces the image's own;
#   2. Cray's libfabric: $PWW_CRAY_LIBFABRIC, else the newest version directory under
#      $PWW_CRAY_LIBFABRIC_ROOT (default /opt/cray/libfabric) that holds libfabric.so.1.
#      Newest, not "the system default": the default is a module setting of the host's
#      login environment, invisible inside the image, while the newest is what each LUMI
#      system update brings (1.15.2.0 before January 2026, 1.22.0 after). Where another
#      must win, PWW_CRAY_LIBFABRIC names it; the smoke job prints the version RCCL loaded
#      ("NET/OFI Using Libfabric version"), to compare with `module show libfabric`;
#   3. /opt/aws-ofi-nccl/lib, the image's plugin;
#   4. /usr/lib64, for the bound libcxi.so.1 (nothing of Ubuntu's lives there to shadow);
#   5. whatever LD_LIBRARY_PATH held already.
# The image holds no libfabric of its own: without the host's, the plugin cannot load and
# RCCL says so (NCCL_DEBUG=INFO: no "NET/OFI" lines, "Using network Socket"), instead of
# quietly running libfabric's TCP provider. smoke.py fails a multi-node run on Socket.

pww_fabric=${PWW_CRAY_LIBFABRIC:-}
if [ -z "$pww_fabric" ]; then
    for pww_d in $(printf '%s\n' "${PWW_CRAY_LIBFABRIC_ROOT:-/opt/cray/libfabric}"/*/lib64 | sort -V); do
        [ -e "$pww_d/libfabric.so.1" ] && pww_fabric=$pww_d
    done
fi
LD_LIBRARY_PATH="${PWW_RCCL_PLUGIN_DIR:+$PWW_RCCL_PLUGIN_DIR:}${pww_fabric:+$pww_fabric:}/opt/aws-ofi-nccl/lib:/usr/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export LD_LIBRARY_PATH
export PWW_FABRIC_LIBDIR="$pww_fabric"      # what was chosen, for smoke.py and the logs
unset pww_fabric pww_d
