# The pmem-csi image: exactly the tree `just image-rootfs` assembles (tools/image-rootfs.sh: our
# binary with the libraries ldd lists, e2fsprogs, xfsprogs, util-linux and mount from Debian),
# so what the chroot test ran is what the image runs. Build context: that tree's parent, e.g.
#   just image-rootfs && docker build -f Dockerfile -t <registry>/pmem-csi:<tag> target/image
FROM scratch
COPY rootfs/ /
ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
ENTRYPOINT ["/usr/local/bin/pmem-csi"]
